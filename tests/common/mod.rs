//! Test helpers: a scripted raw-TCP backend, an HTTP client that keeps every body fragment
//! with its arrival time, and an in-process tokentap on free loopback ports.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokentap::config::Config;
use tokentap::server::Running;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// A free loopback port, handed to pingora (which binds by address). It is picked below
/// the kernel's ephemeral range (32768 and up): a port from `:0` can be taken, before the
/// proxy binds it, as the source port of another test's outgoing connection.
pub fn free_addr() -> SocketAddr {
    use std::sync::atomic::AtomicU16;
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let start = 10_000 + (std::process::id() % 2_000) as u16 * 10;
    loop {
        let port = start + NEXT.fetch_add(1, SeqCst) % 22_000;
        let port = 10_000 + (port - 10_000) % 22_000;
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return l.local_addr().unwrap();
        }
    }
}

/// tokentap in this process, in front of `upstreams` (name, addr), `extra` appended to the
/// config (routes, metrics…).
pub async fn proxy(upstreams: &[(&str, SocketAddr)], extra: &str) -> Running {
    let mut text = format!(
        "[listen]\nproxy = \"{}\"\nadmin = \"{}\"\n",
        free_addr(),
        free_addr()
    );
    for (name, addr) in upstreams {
        text.push_str(&format!(
            "[[upstream]]\nname = \"{name}\"\nurl = \"http://{addr}\"\n"
        ));
    }
    text.push_str(extra);
    let config = Config::parse(&text, "test").unwrap();
    let running = Running::start(config);
    running.wait_ready(Duration::from_secs(10)).await.unwrap();
    running
}

pub fn proxy_addr(r: &Running) -> SocketAddr {
    r.shared().config.listen.proxy
}

/// `/stats` of the running proxy, as JSON.
pub async fn stats(r: &Running) -> serde_json::Value {
    let resp = fetch(r.shared().config.listen.admin, "GET", "/stats", b"").await;
    assert_eq!(resp.status, 200);
    serde_json::from_slice(&resp.body).unwrap()
}

/// The upstream named `name` in a `/stats` document.
pub fn upstream_named<'a>(s: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    s["upstreams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == name)
        .unwrap()
}

/// Polls `/stats` until `cond` holds for the first upstream (the proxy records a request
/// in its logging phase, just after the client has read the last byte).
pub async fn stats_when(
    r: &Running,
    cond: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    stats_where(r, |s| cond(&s["upstreams"][0])).await
}

/// Polls `/stats` until `cond` holds for the whole of it. The deadline (30 s) is for a
/// machine busy with other work: a condition that holds is usually seen in milliseconds.
pub async fn stats_where(
    r: &Running,
    cond: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = stats(r).await;
        if cond(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "condition never held; last stats: {s:#}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A response: status, headers, the body bytes, each body fragment with its arrival time,
/// and whether the body ended in an error.
pub struct Resp {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Vec<u8>,
    pub frames: Vec<(Instant, Bytes)>,
    pub error: bool,
}

pub async fn fetch(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Resp {
    send(addr, method, path, body, &[]).await.unwrap()
}

/// As [`fetch`], with extra request headers; a connection that cannot be made or a
/// response that never comes is an `Err` rather than a panic (a body cut short sets
/// `error`).
pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> Result<Resp, String> {
    let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let mut req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::copy_from_slice(body)))
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let mut b = resp.into_body();
    let (mut out, mut frames, mut error) = (Vec::new(), Vec::new(), false);
    while let Some(f) = b.frame().await {
        match f {
            Ok(f) => {
                if let Ok(d) = f.into_data() {
                    out.extend_from_slice(&d);
                    frames.push((Instant::now(), d));
                }
            }
            Err(_) => {
                error = true;
                break;
            }
        }
    }
    Ok(Resp {
        status,
        headers,
        body: out,
        frames,
        error,
    })
}

/// How a scripted response ends.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The terminating chunk.
    Clean,
    /// A TCP reset in the middle of the chunked body.
    Reset,
}

/// A scripted reply.
#[derive(Clone)]
pub enum Reply {
    /// Chunked: each piece written (and flushed) on its own, `gap` apart.
    Chunked {
        status: u16,
        content_type: &'static str,
        pieces: Vec<Vec<u8>>,
        gap: Duration,
        ending: Ending,
    },
    /// With a Content-Length.
    Whole {
        status: u16,
        content_type: &'static str,
        body: Vec<u8>,
    },
    /// Raw bytes, head and all: each piece written on its own, `gap` apart; `close` ends
    /// the connection after the last.
    Raw {
        pieces: Vec<Vec<u8>>,
        gap: Duration,
        close: bool,
    },
}

/// A raw-TCP backend answering each request path with a scripted reply.
pub struct Mock {
    pub addr: SocketAddr,
    /// Chunked replies the backend could not finish writing: the client went away.
    pub aborted: Arc<AtomicU64>,
    pub requests: Arc<AtomicU64>,
}

pub async fn mock(routes: Vec<(&'static str, Reply)>) -> Mock {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let aborted = Arc::new(AtomicU64::new(0));
    let requests = Arc::new(AtomicU64::new(0));
    let routes = Arc::new(routes);
    let (ab, rq) = (Arc::clone(&aborted), Arc::clone(&requests));
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let (routes, ab, rq) = (Arc::clone(&routes), Arc::clone(&ab), Arc::clone(&rq));
            tokio::spawn(async move {
                while let Some(path) = read_request(&mut s).await {
                    rq.fetch_add(1, SeqCst);
                    let reply = routes
                        .iter()
                        .find(|(p, _)| path == *p)
                        .map(|(_, r)| r.clone())
                        .unwrap_or(Reply::Whole {
                            status: 404,
                            content_type: "application/json",
                            body: br#"{"error":{"message":"not found"}}"#.to_vec(),
                        });
                    if !write_reply(&mut s, reply, &ab).await {
                        return;
                    }
                }
            });
        }
    });
    Mock {
        addr,
        aborted,
        requests,
    }
}

/// Reads one request; returns its path.
async fn read_request(s: &mut TcpStream) -> Option<String> {
    let message = read_message(s).await?;
    let head = String::from_utf8_lossy(&message);
    Some(head.split_whitespace().nth(1)?.to_owned())
}

/// Reads one HTTP/1.1 message whole from `s`, head and body (by its `Content-Length`, or
/// chunked to its last chunk; none without either): its bytes, or `None` when `s` closed
/// or failed first.
pub async fn read_message(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let lower = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let length = lower
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok());
    let chunked = lower.contains("transfer-encoding: chunked");
    let whole = |buf: &[u8]| match length {
        Some(len) => buf.len() - head_end >= len,
        None if chunked => buf[head_end..].windows(5).any(|w| w == b"0\r\n\r\n"),
        None => true,
    };
    while !whole(&buf) {
        let n = s.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    Some(buf)
}

async fn write_reply(s: &mut TcpStream, reply: Reply, aborted: &AtomicU64) -> bool {
    match reply {
        Reply::Raw { pieces, gap, close } => {
            for (i, p) in pieces.iter().enumerate() {
                if i > 0 {
                    tokio::time::sleep(gap).await;
                }
                if s.write_all(p).await.is_err() || s.flush().await.is_err() {
                    return false;
                }
            }
            !close
        }
        Reply::Whole {
            status,
            content_type,
            body,
        } => {
            let head = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            s.write_all(head.as_bytes()).await.is_ok() && s.write_all(&body).await.is_ok()
        }
        Reply::Chunked {
            status,
            content_type,
            pieces,
            gap,
            ending,
        } => {
            let head = format!("HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n");
            if s.write_all(head.as_bytes()).await.is_err() {
                return false;
            }
            for (i, p) in pieces.iter().enumerate() {
                if i > 0 {
                    tokio::time::sleep(gap).await;
                }
                let chunk = [
                    format!("{:x}\r\n", p.len()).into_bytes(),
                    p.clone(),
                    b"\r\n".to_vec(),
                ]
                .concat();
                if s.write_all(&chunk).await.is_err() || s.flush().await.is_err() {
                    aborted.fetch_add(1, SeqCst);
                    return false;
                }
            }
            match ending {
                Ending::Clean => s.write_all(b"0\r\n\r\n").await.is_ok(),
                Ending::Reset => {
                    // SO_LINGER 0 (which cannot block: nothing lingers): closing sends a
                    // reset, not a clean FIN.
                    #[allow(deprecated)]
                    let _ = s.set_linger(Some(Duration::ZERO));
                    false
                }
            }
        }
    }
}

/// An OpenAI chat stream of `n` content tokens, with a usage chunk when `usage`.
pub fn chat_events(n: usize, usage: bool) -> Vec<Vec<u8>> {
    let mut v = vec![br#"data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#.to_vec()];
    for i in 0..n {
        let finish = if i + 1 == n { r#""stop""# } else { "null" };
        v.push(format!(r#"data: {{"id":"c1","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"content":"t{i} é"}},"finish_reason":{finish}}}]}}"#).into_bytes());
    }
    if usage {
        v.push(format!(r#"data: {{"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":{n},"total_tokens":{}}}}}"#, n + 3).into_bytes());
    }
    v.push(b"data: [DONE]".to_vec());
    v.into_iter()
        .map(|mut e| {
            e.extend_from_slice(b"\n\n");
            e
        })
        .collect()
}

/// A whole chunked `200` response carrying `events` (one chunk each) as an event stream.
pub fn chunked_sse_response(events: Vec<Vec<u8>>) -> Vec<u8> {
    chunked_sse_response_with(events, "")
}

/// As [`chunked_sse_response`], with `extra` head fields (each ending in CRLF).
pub fn chunked_sse_response_with(events: Vec<Vec<u8>>, extra: &str) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n{extra}transfer-encoding: chunked\r\n\r\n"
    )
    .into_bytes();
    for e in events {
        out.extend_from_slice(format!("{:x}\r\n", e.len()).as_bytes());
        out.extend_from_slice(&e);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}
mod backend;
pub mod process;

/// The suite's tests run in one process, on libtest's threads. Those that measure shares,
/// speeds or latencies under load take a slot of the machine's two cores: at most two of
/// them at once ([`load_slot`]), or one alone ([`whole_machine`], for an open loop whose
/// rate is what it measures, a latency compared within a millisecond). The rest (a
/// request or two, a parser) run beside them.
static LOAD: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// A core's share of the machine for a test under load, held until dropped (FIFO).
pub async fn load_slot() -> tokio::sync::SemaphorePermit<'static> {
    LOAD.acquire().await.unwrap()
}

/// The whole machine for a test under load, held until dropped (FIFO with [`load_slot`]).
pub async fn whole_machine() -> tokio::sync::SemaphorePermit<'static> {
    LOAD.acquire_many(2).await.unwrap()
}
#[allow(unused_imports)]
pub use backend::{closed_loop, sim, Closed, IntoCurve, SimSpec};
