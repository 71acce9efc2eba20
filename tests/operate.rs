//! What an operator sees when things go wrong, on the real binary: an unreachable upstream,
//! a refused TLS certificate and an upstream timeout each give the client a JSON error
//! naming the cause, and one log line naming the upstream; a private CA (`ca_file`) and
//! `tls_verify = false` reach a TLS upstream; the proxy listener speaks TLS; the access log
//! has a line per request; and no secret (a header value, a cookie, the prompt, a query
//! string) appears in anything tokentap writes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::process::{listen_section, Scratch, Tokentap};
use common::*;
use nix::sys::signal::Signal;
use pingora::tls::{
    CertificateDer, ClientConfig, PrivateKeyDer, RootCertStore, ServerConfig, ServerName,
    TlsAcceptor, TlsConnector,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A CA and a certificate for `localhost` it signed: (CA PEM, cert PEM, key PEM).
fn pki() -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "tokentap test CA");
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    (ca.pem(), leaf.pem(), key.serialize_pem())
}

fn der_chain(pem: &str) -> Vec<CertificateDer<'static>> {
    use rustls_pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .map(Result::unwrap)
        .collect()
}

fn server_config(cert: &str, key: &str) -> Arc<ServerConfig> {
    use rustls_pki_types::pem::PemObject;
    pingora::tls::install_default_crypto_provider();
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
    Arc::new(
        ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(der_chain(cert), key)
            .unwrap(),
    )
}

/// Answers every request on `io` with a small JSON body until the peer closes.
async fn answer_json<S: AsyncRead + AsyncWrite + Unpin>(mut io: S, heads: Option<Heads>) {
    let mut buf = Vec::new();
    loop {
        let mut chunk = [0u8; 4096];
        let Ok(n) = io.read(&mut chunk).await else {
            return;
        };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            if let Some(heads) = &heads {
                heads
                    .lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&buf[..end]).into_owned());
            }
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if buf.len() < end + 4 + len {
                break;
            }
            buf.drain(..end + 4 + len);
            let body = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;
            let resp = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            );
            if io.write_all(resp.as_bytes()).await.is_err() {
                return;
            }
        }
    }
}

/// A TLS origin with `cert`.
async fn tls_origin(cert: &str, key: &str) -> SocketAddr {
    let acceptor = TlsAcceptor::from(server_config(cert, key));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    answer_json(tls, None).await;
                }
            });
        }
    });
    addr
}

/// A plain origin that records each request head it gets.
type Heads = Arc<std::sync::Mutex<Vec<String>>>;

async fn recording_origin() -> (SocketAddr, Heads) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = Arc::clone(&heads);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(answer_json(tcp, Some(Arc::clone(&kept))));
        }
    });
    (addr, heads)
}

/// A server that accepts and never answers.
async fn silent() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = listener.accept().await {
            held.push(tcp);
        }
    });
    addr
}

const CHAT: &[u8] = br#"{"model":"test-model","messages":[{"role":"user","content":"hello"}]}"#;

fn error_of(r: &Resp) -> (String, String) {
    let v: serde_json::Value = serde_json::from_slice(&r.body)
        .unwrap_or_else(|_| panic!("not JSON: {:?}", String::from_utf8_lossy(&r.body)));
    (
        v["error"]["code"].as_str().unwrap_or("").to_owned(),
        v["error"]["message"].as_str().unwrap_or("").to_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_explain_themselves_to_the_client_and_in_one_log_line() {
    let (ca, cert, key) = pki();
    let dir = Scratch::new("operate");
    std::fs::write(dir.path("ca.pem"), &ca).unwrap();
    let origin = tls_origin(&cert, &key).await;
    let (plain, heads) = recording_origin().await;
    let slow = silent().await;
    let dead = free_addr();
    let port = origin.port();
    let ca_file = dir.path("ca.pem");
    let access = dir.path("access.log");
    let (listen, proxy, admin) = listen_section();
    let route = |name: &str| {
        format!("[[route]]\npath_prefix = \"/\"\nheaders = {{ \"x-to\" = \"{name}\" }}\nsplit = {{ {name} = 1 }}\n")
    };
    let config = format!(
        "{listen}[log]\naccess = \"{}\"\n\
         [[upstream]]\nname = \"dead\"\nurl = \"http://{dead}\"\n\
         [[upstream]]\nname = \"slow\"\nurl = \"http://{slow}\"\nread_timeout_secs = 1\n\
         [[upstream]]\nname = \"untrusted\"\nurl = \"https://localhost:{port}\"\n\
         [[upstream]]\nname = \"private\"\nurl = \"https://localhost:{port}\"\nca_file = \"{}\"\n\
         [[upstream]]\nname = \"unverified\"\nurl = \"https://localhost:{port}\"\ntls_verify = false\n\
         [[upstream]]\nname = \"plain\"\nurl = \"http://{plain}\"\n\
         {}{}{}{}{}{}",
        access.display(),
        ca_file.display(),
        route("dead"),
        route("slow"),
        route("untrusted"),
        route("private"),
        route("unverified"),
        route("plain"),
    );
    let secrets = [
        ("authorization", "Bearer sk-SECRET-AUTH-1"),
        ("x-api-key", "SECRET-KEY-2"),
        ("cookie", "session=SECRET-COOKIE-3"),
    ];
    let mut tap = Tokentap::start(&dir.0, &config, proxy, admin, &[("RUST_LOG", "debug")]);
    tap.log_line(
        &["upstream unverified", "tls_verify = false"],
        Duration::from_secs(5),
    );
    tap.log_line(&["proxy listening on http://"], Duration::from_secs(5));

    let secret_chat =
        br#"{"model":"test-model","messages":[{"role":"user","content":"SECRET-PROMPT-4"}]}"#;
    let ask = |to: &'static str, id: Option<&'static str>| {
        let mut headers: Vec<(&str, &str)> = secrets.to_vec();
        headers.push(("x-to", to));
        if let Some(id) = id {
            headers.push(("x-request-id", id));
        }
        async move {
            send(
                proxy,
                "POST",
                "/v1/chat/completions?key=SECRET-QUERY-5",
                secret_chat,
                &headers,
            )
            .await
            .unwrap()
        }
    };

    // Unreachable: 502, upstream_connect_failed, the upstream named, one log line.
    let r = ask("dead", Some("client-id-1")).await;
    assert_eq!(r.status, 502);
    assert_eq!(r.headers["x-tokentap-upstream"], "dead");
    assert_eq!(r.headers["x-request-id"], "client-id-1");
    let (code, message) = error_of(&r);
    assert_eq!(code, "upstream_connect_failed", "{message}");
    assert!(message.contains("dead"), "{message}");
    let line = tap.log_line(&["client-id-1", "connect_refused"], Duration::from_secs(5));
    assert!(line.contains("dead"), "{line}");
    // The replica of the upstream's pool it went to.
    assert!(line.contains("endpoint=\"http://127.0.0.1:"), "{line}");

    // Silent past read_timeout_secs: 504, upstream_timeout.
    let r = ask("slow", None).await;
    assert_eq!(r.status, 504);
    let (code, _) = error_of(&r);
    assert_eq!(code, "upstream_timeout");
    let id = r.headers["x-request-id"].to_str().unwrap().to_owned();
    let uuid = uuid::Uuid::parse_str(&id).unwrap();
    assert_eq!(uuid.get_version(), Some(uuid::Version::Random), "{id}");
    let line = tap.log_line(&[&id, "read_timeout"], Duration::from_secs(5));
    assert!(line.contains("slow"), "{line}");

    // A certificate from a CA nobody trusts: 502, upstream_tls_error with the reason.
    let r = ask("untrusted", None).await;
    assert_eq!(r.status, 502);
    let (code, message) = error_of(&r);
    assert_eq!(code, "upstream_tls_error", "{message}");
    assert!(
        message.to_lowercase().contains("certificate") || message.contains("UnknownIssuer"),
        "{message}"
    );
    let line = tap.log_line(&["untrusted", "cause", "tls"], Duration::from_secs(5));
    assert!(
        line.contains("upstream_tls_error") || line.contains("TLS"),
        "{line}"
    );

    // The private CA in ca_file, and no verification at all, both reach it.
    for to in ["private", "unverified"] {
        let r = ask(to, None).await;
        assert_eq!(
            r.status,
            200,
            "{to}: {:?}",
            String::from_utf8_lossy(&r.body)
        );
    }
    // A request id goes upstream: the client's as it is, else tokentap's.
    assert_eq!(ask("plain", Some("client-id-2")).await.status, 200);
    let r = ask("plain", None).await;
    let ours = r.headers["x-request-id"].to_str().unwrap().to_owned();
    let heads = heads.lock().unwrap().clone();
    assert!(
        heads
            .iter()
            .any(|h| h.contains("x-request-id: client-id-2")),
        "{heads:?}"
    );
    assert!(
        heads
            .iter()
            .any(|h| h.contains(&format!("x-request-id: {ours}"))),
        "{heads:?}"
    );

    tap.signal(Signal::SIGTERM);
    let (status, _) = tap.wait_exit(Duration::from_secs(10)).expect("exits");
    assert!(status.success());

    // The access log: one JSON line per request, with every field.
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&access)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 7, "{lines:#?}");
    for field in [
        "ts",
        "request_id",
        "method",
        "path",
        "upstream",
        "endpoint",
        "route",
        "status",
        "outcome",
        "dialect",
        "model",
        "stream",
        "queue_ms",
        "ttft_ms",
        "tpot_ms",
        "e2e_ms",
        "input_tokens",
        "output_tokens",
        "counts",
        "bytes_out",
        "client",
    ] {
        assert!(
            lines.iter().all(|l| l.get(field).is_some()),
            "no {field}: {lines:#?}"
        );
    }
    let first = &lines[0];
    assert_eq!(first["request_id"], "client-id-1");
    assert_eq!(first["status"], 502);
    assert_eq!(first["cause"], "connect_refused");
    assert_eq!(first["path"], "/v1/chat/completions");
    let ok = lines.iter().find(|l| l["upstream"] == "private").unwrap();
    assert_eq!(ok["status"], 200);
    assert!(ok["endpoint"].as_str().unwrap().starts_with("http"), "{ok}");
    assert_eq!(ok["outcome"], "ok");
    assert_eq!(ok["dialect"], "openai");
    assert_eq!(ok["model"], "test-model");
    assert_eq!(
        (ok["input_tokens"].as_u64(), ok["output_tokens"].as_u64()),
        (Some(3), Some(1))
    );
    assert_eq!(ok["counts"], "exact");
    assert!(ok["bytes_out"].as_u64().unwrap() > 100);
    assert!(ok["ts"].as_str().unwrap().ends_with('Z'));

    // No secret anywhere.
    let everything = format!(
        "{}{}{}",
        tap.stderr(),
        tap.stdout(),
        std::fs::read_to_string(&access).unwrap()
    );
    assert!(
        everything.contains("DEBUG") || everything.contains("debug"),
        "debug logging was on"
    );
    for secret in [
        "SECRET-AUTH",
        "SECRET-KEY",
        "SECRET-COOKIE",
        "SECRET-PROMPT",
        "SECRET-QUERY",
    ] {
        assert!(
            !everything.contains(secret),
            "{secret} leaked:\n{everything}"
        );
    }
    let _ = CHAT;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_listener_speaks_tls() {
    let (ca, cert, key) = pki();
    let dir = Scratch::new("tls-listen");
    for (name, text) in [("ca.pem", &ca), ("cert.pem", &cert), ("key.pem", &key)] {
        std::fs::write(dir.path(name), text).unwrap();
    }
    let origin = tls_origin(&cert, &key).await;
    let (listen, proxy, admin) = listen_section();
    let config = format!(
        "{listen}tls_cert = \"{}\"\ntls_key = \"{}\"\n\
         [[upstream]]\nname = \"private\"\nurl = \"https://localhost:{}\"\nca_file = \"{}\"\n",
        dir.path("cert.pem").display(),
        dir.path("key.pem").display(),
        origin.port(),
        dir.path("ca.pem").display(),
    );
    let tap = Tokentap::start(&dir.0, &config, proxy, admin, &[]);
    tap.log_line(&["proxy listening on https://"], Duration::from_secs(5));

    let mut roots = RootCertStore::empty();
    for c in der_chain(&ca) {
        roots.add(c).unwrap();
    }
    let client = ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = TlsConnector::from(Arc::new(client));
    let tcp = TcpStream::connect(proxy).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        CHAT.len()
    );
    tls.write_all(req.as_bytes()).await.unwrap();
    tls.write_all(CHAT).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut got)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("chat.completion"), "{text}");

    // A plain-HTTP client gets no answer from a TLS listener, and the proxy stays up.
    let mut plain = TcpStream::connect(proxy).await.unwrap();
    let _ = plain.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut buf)).await;
    assert!(!String::from_utf8_lossy(&buf).contains("HTTP/1.1 200"));
    assert_eq!(fetch(admin, "GET", "/healthz", b"").await.status, 200);
}
