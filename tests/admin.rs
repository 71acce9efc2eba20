//! The admin listener holds against the web pages an operator has open and anyone without
//! the token: DNS rebinding (a foreign `Host`) gets 421, a cross-site `POST` 403, a missing
//! or wrong bearer token 401; `HEAD` works wherever `GET` does; long URIs get 414.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `head` (with `Connection: close` added) and returns the status and the response.
async fn raw(admin: SocketAddr, head: &str) -> (u16, String) {
    let mut s = TcpStream::connect(admin).await.unwrap();
    let req = format!("{head}Connection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "no answer to {head:?}");
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_admin_still_refuses_other_sites() {
    let backend = mock(vec![]).await;
    let running = proxy(&[("up", backend.addr)], "").await;
    let admin = running.shared().config.listen.admin;
    let host = format!("Host: {admin}\r\n");

    let (status, _) = raw(admin, &format!("GET /stats HTTP/1.1\r\n{host}")).await;
    assert_eq!(status, 200);
    let (status, _) = raw(
        admin,
        &format!(
            "GET /stats HTTP/1.1\r\nHost: localhost:{}\r\n",
            admin.port()
        ),
    )
    .await;
    assert_eq!(status, 200, "localhost is the listener too");
    let (status, text) = raw(admin, "GET /stats HTTP/1.1\r\nHost: rebound.example\r\n").await;
    assert_eq!(status, 421, "{text}");

    let reset = |origin: &str| {
        format!("POST /compare/reset HTTP/1.1\r\n{host}Origin: {origin}\r\nContent-Length: 0\r\n")
    };
    let (status, _) = raw(admin, &reset("https://evil.example")).await;
    assert_eq!(status, 403);
    let (status, _) = raw(admin, &reset(&format!("http://{admin}"))).await;
    assert_eq!(status, 200, "its own page may post");
    let (status, _) = raw(
        admin,
        &format!("POST /compare/reset HTTP/1.1\r\n{host}Content-Length: 0\r\n"),
    )
    .await;
    assert_eq!(status, 200, "curl sends no Origin");

    let (status, text) = raw(admin, &format!("HEAD /stats HTTP/1.1\r\n{host}")).await;
    assert_eq!(status, 200, "{text}");
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase().contains("content-length:"),
        "{head}"
    );
    assert!(body.is_empty(), "HEAD got a body: {body:?}");
    // `HEAD /events` as `GET /events` (its head: an event stream), without the stream.
    let (status, text) = raw(admin, &format!("HEAD /events HTTP/1.1\r\n{host}")).await;
    assert_eq!(status, 200, "{text}");
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/event-stream"),
        "{head}"
    );
    assert!(body.is_empty(), "HEAD got a body: {body:?}");
    // A path spelt otherwise reads as the one a server behind a decoding front would.
    for path in ["//stats", "/%73tats", "/stats/", "/x/../stats"] {
        let (status, text) = raw(admin, &format!("GET {path} HTTP/1.1\r\n{host}")).await;
        assert_eq!(status, 200, "{path}: {text}");
    }

    let long = "a".repeat(9 * 1024);
    let (status, _) = raw(admin, &format!("GET /stats?{long} HTTP/1.1\r\n{host}")).await;
    assert_eq!(status, 414);

    // An HTTP/1.0 client's reply ends with the connection (it has nothing else to read
    // its end by); an HTTP/1.1 client's stays open for the next request.
    for (version, closes) in [("1.0", true), ("1.1", false)] {
        let mut s = TcpStream::connect(admin).await.unwrap();
        let req = format!("GET /healthz HTTP/{version}\r\n{host}\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let wait = Duration::from_millis(if closes { 5_000 } else { 500 });
        let read = tokio::time::timeout(wait, s.read_to_end(&mut got)).await;
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 200"), "HTTP/{version}: {text}");
        assert_eq!(read.is_ok(), closes, "HTTP/{version}: {text}");
    }
    running.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_locks_every_endpoint_but_healthz_and_the_page() {
    let dir = std::env::temp_dir().join(format!("tokentap-admin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, "s3cret-token\n").unwrap();
    let backend = mock(vec![]).await;
    for public in [false, true] {
        let extra = format!(
            "[admin]\ntoken_file = \"{}\"\nmetrics_public = {public}\n",
            file.display()
        );
        let running = proxy(&[("up", backend.addr)], &extra).await;
        let admin = running.shared().config.listen.admin;
        let host = format!("Host: {admin}\r\n");
        let get = |path: &str, auth: &str| format!("GET {path} HTTP/1.1\r\n{host}{auth}");

        let (status, text) = raw(admin, &get("/stats", "")).await;
        assert_eq!(status, 401, "{text}");
        assert!(
            text.to_ascii_lowercase()
                .contains("www-authenticate: bearer"),
            "{text}"
        );
        assert!(!text.contains("s3cret"), "the token is never echoed");
        let (status, _) = raw(admin, &get("/stats", "Authorization: Bearer wrong\r\n")).await;
        assert_eq!(status, 401);
        let (status, _) = raw(
            admin,
            &get("/stats", "Authorization: Bearer s3cret-token\r\n"),
        )
        .await;
        assert_eq!(status, 200);
        let (status, _) = raw(admin, &get("/healthz", "")).await;
        assert_eq!(status, 200, "/healthz stays open");
        let (status, _) = raw(admin, &get("/metrics", "")).await;
        assert_eq!(
            status,
            if public { 200 } else { 401 },
            "metrics_public = {public}"
        );
        for data in ["/stats/history", "/events", "/compare"] {
            let (status, _) = raw(admin, &get(data, "")).await;
            assert_eq!(status, 401, "{data}");
        }
        // The dashboard's files hold no figures and load without the token; /auth tells
        // the page whether its token is good.
        for open in ["/", "/assets/dashboard.js", "/assets/uPlot.iife.min.js"] {
            let (status, _) = raw(admin, &get(open, "")).await;
            assert_eq!(status, 200, "{open}");
        }
        let (_, text) = raw(admin, &get("/auth", "")).await;
        assert!(text.contains(r#""authorized":false"#), "{text}");
        let (_, text) = raw(
            admin,
            &get("/auth", "Authorization: Bearer s3cret-token\r\n"),
        )
        .await;
        assert!(text.contains(r#""authorized":true"#), "{text}");
        let post = format!("POST /compare/reset HTTP/1.1\r\n{host}Content-Length: 0\r\n");
        let (status, _) = raw(admin, &post).await;
        assert_eq!(status, 401);
        running.stop();
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_push_a_snapshot_a_second_and_history_keeps_them() {
    let backend = mock(vec![]).await;
    let running = proxy(&[("up", backend.addr)], "").await;
    let admin = running.shared().config.listen.admin;
    let mut s = TcpStream::connect(admin).await.unwrap();
    let req = format!("GET /events HTTP/1.1\r\nHost: {admin}\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    let snapshots = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .matches("event: snapshot\n")
            .count()
    };
    while snapshots(&got) < 3 {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("a snapshot every second")
            .unwrap();
        assert!(n > 0, "the stream ended: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text
        .to_ascii_lowercase()
        .contains("content-type: text/event-stream"));
    let data = text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
    let snap: serde_json::Value = serde_json::from_str(data).unwrap();
    assert_eq!(snap["stats"]["upstreams"][0]["name"], "up");
    assert_eq!(snap["point"]["upstreams"][0]["name"], "up");
    assert!(snap["t"].as_u64() > Some(0));
    drop(s);

    let (status, text) = raw(
        admin,
        &format!("GET /stats/history HTTP/1.1\r\nHost: {admin}\r\n"),
    )
    .await;
    assert_eq!(status, 200);
    let body = &text[text.find("\r\n\r\n").unwrap() + 4..];
    let history: serde_json::Value = serde_json::from_str(body).unwrap();
    let points = history["points"].as_array().unwrap();
    assert!(points.len() >= 2, "{history}");
    assert!(points
        .windows(2)
        .all(|w| w[0]["t"].as_u64() < w[1]["t"].as_u64()));
    running.stop();
}
