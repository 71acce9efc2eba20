//! 200 connections each sending 900 KiB of a head that never ends: every one gets 431 once
//! its head passes `max_request_head_bytes` (64 KiB), and tokentap's resident memory grows
//! by less than 32 MB (it grew by 184 MB when heads of up to 1 MiB were buffered).
//! tokentap runs as a process of its own, so nothing else the suite runs moves its RSS.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Barrier;

/// Process `pid`'s resident set, bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_huge_heads_are_refused_without_holding_memory() {
    const CONNECTIONS: usize = 200;
    const HEAD: usize = 900 * 1024;
    let backend = mock(vec![]).await;
    let dir = common::process::Scratch::new("head-flood");
    let (listen, addr, admin) = common::process::listen_section();
    let config = format!(
        "{listen}[[upstream]]\nname = \"up\"\nurl = \"http://{}\"\n",
        backend.addr
    );
    let tap = common::process::Tokentap::start(&dir.0, &config, addr, admin, &[]);
    let pid = tap.child.id();
    // Warm up: the runtime's threads and buffers exist before the baseline.
    assert_eq!(fetch(addr, "GET", "/x", b"").await.status, 404);
    let before = rss(pid);

    let piece: Arc<Vec<u8>> = Arc::new(b"x".repeat(16 * 1024));
    let all_sent = Arc::new(Barrier::new(CONNECTIONS + 1));
    let mut clients = Vec::new();
    for _ in 0..CONNECTIONS {
        let (piece, all_sent) = (Arc::clone(&piece), Arc::clone(&all_sent));
        clients.push(tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            let mut sent = 0;
            let mut ok = s
                .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: ")
                .await
                .is_ok();
            while ok && sent < HEAD {
                let write = s.write_all(&piece);
                ok = matches!(
                    tokio::time::timeout(Duration::from_secs(10), write).await,
                    Ok(Ok(()))
                );
                sent += piece.len();
            }
            all_sent.wait().await;
            let mut got = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
            String::from_utf8_lossy(&got).into_owned()
        }));
    }
    // Every client has sent all it could and still holds its connection.
    all_sent.wait().await;
    let grown = rss(pid).saturating_sub(before);
    let mut refused = 0;
    for c in clients {
        let answer = c.await.unwrap();
        refused += usize::from(answer.starts_with("HTTP/1.1 431"));
    }
    eprintln!(
        "RSS grew by {:.1} MB for {CONNECTIONS} connections; {refused} got 431",
        grown as f64 / 1e6
    );
    assert!(grown < 32_000_000, "RSS grew by {grown} bytes");
    // A client whose write failed on the reset may not have read its 431; most do.
    assert!(refused >= CONNECTIONS / 2, "only {refused} got 431");
    drop(tap);
}
