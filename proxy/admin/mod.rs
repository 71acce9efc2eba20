//! The admin listener: the dashboard (`/`), `/stats` (JSON), `/stats/history`, `/events`
//! (server-sent snapshots), `/metrics` (Prometheus), `/compare`, `/rollout`, `/healthz`. It
//! reads the meter, never the proxy.

mod dashboard;
pub mod history;
pub mod metrics;
mod query;
mod report;
mod rollout;

use query::paired_query;
pub use query::{compare, default_paired, paired};
pub use report::{
    is_mirror, stats, Arm, ConnectionStats, ShadowStats, SloStats, Stats, UpstreamReport,
};

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use http::{Response, StatusCode};
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;

use history::History;

use crate::service::Transport;
use crate::state::{Live, Shared};

/// The admin HTTP app.
pub struct Admin {
    live: Arc<Live>,
    transport: Arc<Transport>,
    history: Arc<History>,
}

// === impl Admin ===

impl Admin {
    pub fn new(live: Arc<Live>, transport: Arc<Transport>, history: Arc<History>) -> Self {
        Admin {
            live,
            transport,
            history,
        }
    }
}

/// The request's path as a server behind a decoding front reads it (`//stats`, `/%73tats`
/// and `/stats/` are `/stats`): the guard and the endpoints read the same one.
fn path_of(req: &pingora::http::RequestHeader) -> std::borrow::Cow<'_, str> {
    crate::routing::path::canonical(req.uri.path())
}

fn respond(status: StatusCode, content_type: &str, body: Vec<u8>) -> Response<Vec<u8>> {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        resp.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    if let Ok(v) = resp.body().len().to_string().parse() {
        resp.headers_mut().insert(http::header::CONTENT_LENGTH, v);
    }
    resp
}

fn json_error(status: StatusCode, message: &str) -> Response<Vec<u8>> {
    let body = serde_json::json!({ "error": { "message": message } }).to_string();
    respond(status, "application/json", body.into_bytes())
}

/// How long one `/events` message may take to write before the subscriber is dropped (it
/// stopped reading).
const EVENT_WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

#[async_trait]
impl HttpServerApp for Admin {
    async fn process_new_http(
        self: &Arc<Self>,
        mut http: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        match http.read_request().await {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => {
                tracing::debug!(error = %e, "admin: reading a request failed");
                return None;
            }
        }
        // Kept for another request as the proxy's listener keeps one: an HTTP/1.1 client's
        // that did not say `close` (pingora sees that), not an HTTP/1.0 client's, whose reply
        // ends with the connection (RFC 9112 §9.3).
        let http11 = http.req_header().version == http::Version::HTTP_11;
        http.set_keepalive((!*shutdown.borrow() && http11).then_some(60));
        let req = http.req_header();
        if req.method == http::Method::GET && path_of(req) == "/events" {
            let shared = self.live.load();
            if guard(&shared, req).is_none() {
                self.events(&mut http, shutdown.clone()).await;
                return None;
            }
        }
        let resp = self.response(&mut http).await;
        let (parts, body) = resp.into_parts();
        let head: ResponseHeader = parts.into();
        if http.write_response_header(Box::new(head)).await.is_err() {
            return None;
        }
        if !body.is_empty() && http.write_response_body(body.into(), true).await.is_err() {
            return None;
        }
        let settings = HttpPersistentSettings::for_session(&http);
        match http.finish().await {
            Ok(reusable) => reusable.map(|s| ReusedHttpStream::from_reusable_stream(s, settings)),
            Err(_) => None,
        }
    }
}

impl Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let req = session.req_header();
        let shared = self.live.load();
        if let Some(refused) = guard(&shared, req) {
            return refused;
        }
        let path = path_of(req);
        if req.method == http::Method::POST && path == "/reload" {
            return self.reload().await;
        }
        if req.method == http::Method::POST && path.starts_with("/rollout/") {
            // The state is looked up again once the body has come (a reload may come first).
            return rollout::steer(&self.live, session).await;
        }
        if req.method != http::Method::HEAD {
            return self.serve(&shared, req);
        }
        // HEAD: GET's status and fields, without the body.
        let mut resp = self.serve(&shared, req);
        resp.body_mut().clear();
        resp
    }

    /// `GET /events`: the snapshot of this second, then one a second as the sampler makes
    /// them, until the client leaves, stops reading, or the server shuts down.
    async fn events(&self, http: &mut ServerSession, mut shutdown: ShutdownWatch) {
        let Some(mut sub) = self.history.subscribe() else {
            let resp = json_error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!(
                    "{} /events streams are open already",
                    history::MAX_SUBSCRIBERS
                ),
            );
            let (parts, body) = resp.into_parts();
            let head: ResponseHeader = parts.into();
            if http.write_response_header(Box::new(head)).await.is_ok() {
                let _ = http.write_response_body(body.into(), true).await;
            }
            return;
        };
        http.set_keepalive(None);
        // Asked again before every message: a reload that changes the token ends the
        // streams the old one opened.
        let req = http.req_header().clone();
        let mut head = ResponseHeader::build(200, Some(4)).unwrap_or_else(|_| {
            ResponseHeader::build_no_case(200, None).unwrap_or_else(|_| unreachable!())
        });
        for (k, v) in [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-store"),
            ("transfer-encoding", "chunked"),
            ("x-content-type-options", "nosniff"),
        ] {
            let _ = head.insert_header(k, v);
        }
        let head = http.write_response_header(Box::new(head)).await.is_ok();
        if !head || !send(http, Bytes::from_static(b"retry: 2000\n\n")).await {
            return;
        }
        let mut current = sub.updates.borrow_and_update().clone();
        loop {
            if !authorized(&self.live.load(), &req) {
                break;
            }
            if !current.is_empty() {
                let message = format!("event: snapshot\ndata: {current}\n\n");
                if !send(http, Bytes::from(message)).await {
                    return;
                }
            }
            tokio::select! {
                changed = sub.updates.changed() => {
                    if changed.is_err() {
                        break;
                    }
                }
                _ = shutdown.changed() => break,
            }
            current = sub.updates.borrow_and_update().clone();
        }
        let _ = http.write_response_body(Bytes::new(), true).await;
    }
}

/// Writes one `/events` message; false when the client left or stopped reading.
async fn send(http: &mut ServerSession, data: Bytes) -> bool {
    tokio::time::timeout(EVENT_WRITE_TIMEOUT, http.write_response_body(data, false))
        .await
        .is_ok_and(|r| r.is_ok())
}

// === impl Admin: who may ask ===

/// The longest admin request-target answered.
const MAX_ADMIN_URI: usize = 8 * 1024;

/// The answer to a request that may not be served: a URI too long (414), a `Host` that
/// is neither this listener's address nor `localhost` (421: DNS rebinding), a `POST`
/// from another origin (403: a web page the operator has open), or a missing or wrong
/// token (401).
fn guard(shared: &Shared, req: &pingora::http::RequestHeader) -> Option<Response<Vec<u8>>> {
    if req.raw_path().len() > MAX_ADMIN_URI {
        return Some(json_error(
            StatusCode::URI_TOO_LONG,
            "the request-target is longer than 8 KiB",
        ));
    }
    let admin = shared.config.listen.admin;
    let header = |name: http::header::HeaderName| {
        req.headers.get(name).map(|v| v.to_str().unwrap_or("\u{0}"))
    };
    if let Some(host) = header(http::header::HOST) {
        if !own_authority(host, admin) {
            return Some(json_error(
                StatusCode::MISDIRECTED_REQUEST,
                "the Host is neither this admin listener's address nor localhost",
            ));
        }
    }
    if req.method == http::Method::POST {
        let origin = header(http::header::ORIGIN);
        let same = |o: &str| {
            o.strip_prefix("http://")
                .or_else(|| o.strip_prefix("https://"))
                .is_some_and(|authority| own_authority(authority, admin))
        };
        if origin.is_some_and(|o| !same(o)) {
            return Some(json_error(
                StatusCode::FORBIDDEN,
                "a POST from another origin is refused",
            ));
        }
    }
    let auth = &shared.config.admin;
    let path = path_of(req);
    let path = &*path;
    // The page and its scripts hold no figures: they load without the token, then ask
    // for it to read the data endpoints (`/auth` tells them whether one is needed).
    let open = path == "/healthz"
        || path == "/readyz"
        || path == "/auth"
        || dashboard::is_static(path)
        || (path == "/metrics" && auth.metrics_public);
    if !open && !authorized(shared, req) {
        let mut resp = json_error(
            StatusCode::UNAUTHORIZED,
            "this admin API needs Authorization: Bearer TOKEN (admin.token_file or TOKENTAP_ADMIN_TOKEN)",
        );
        if let Ok(v) = "Bearer".parse() {
            resp.headers_mut().insert(http::header::WWW_AUTHENTICATE, v);
        }
        return Some(resp);
    }
    None
}

/// Whether the request may read the admin API: no token is set, or it carries the token.
fn authorized(shared: &Shared, req: &pingora::http::RequestHeader) -> bool {
    let Some(token) = &shared.config.admin.token else {
        return true;
    };
    let given = req
        .headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    constant_time_eq(given.trim().as_bytes(), token.0.as_bytes())
}

impl Admin {
    /// `POST /reload`: the config file read again, off the admin's thread (it reads files
    /// and resolves names); `{"ok", "problems", "notes"}`, 200 or 422.
    async fn reload(&self) -> Response<Vec<u8>> {
        let live = Arc::clone(&self.live);
        let done = tokio::task::spawn_blocking(move || live.reload("POST /reload"));
        let Ok(reloaded) = done.await else {
            return json_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the reload did not finish",
            );
        };
        let status = if reloaded.ok {
            StatusCode::OK
        } else {
            StatusCode::UNPROCESSABLE_ENTITY
        };
        match serde_json::to_vec_pretty(&reloaded) {
            Ok(body) => respond(status, "application/json", body),
            Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
        }
    }

    fn serve(&self, shared: &Shared, req: &pingora::http::RequestHeader) -> Response<Vec<u8>> {
        let path = path_of(req);
        if req.method == http::Method::POST && path == "/curve/reset" {
            for u in &shared.upstreams {
                u.meter.reset_curve();
            }
            return respond(
                StatusCode::OK,
                "application/json",
                br#"{"reset":true}"#.to_vec(),
            );
        }
        if req.method == http::Method::POST && path == "/compare/reset" {
            for u in &shared.upstreams {
                u.meter.reset_samples();
            }
            return respond(
                StatusCode::OK,
                "application/json",
                br#"{"reset":true}"#.to_vec(),
            );
        }
        if req.method != http::Method::GET && req.method != http::Method::HEAD {
            return json_error(
                StatusCode::METHOD_NOT_ALLOWED,
                "use GET or HEAD (or POST /reload, POST /compare/reset, POST /curve/reset, POST /rollout/ROUTE)",
            );
        }
        match &*path {
            "/compare" if paired_query(shared, req.uri.query()).is_some() => {
                match paired_query(shared, req.uri.query())
                    .and_then(|(a, b)| paired(shared, a, b))
                    .map(|c| serde_json::to_vec_pretty(&c))
                {
                    Some(Ok(body)) => respond(StatusCode::OK, "application/json", body),
                    Some(Err(e)) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
                    None => json_error(StatusCode::NOT_FOUND, "no mirror pairs"),
                }
            }
            "/compare" => match compare(shared, req.uri.query()) {
                Ok(c) => match serde_json::to_vec_pretty(&c) {
                    Ok(body) => respond(StatusCode::OK, "application/json", body),
                    Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
                },
                Err((status, message)) => json_error(status, &message),
            },
            "/stats" => match serde_json::to_vec_pretty(&stats(shared, &self.transport)) {
                Ok(body) => respond(StatusCode::OK, "application/json", body),
                Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
            },
            "/metrics" => {
                let stats = stats(shared, &self.transport);
                let meters: Vec<_> = shared
                    .upstreams
                    .iter()
                    .map(|u| metrics::MeterParts {
                        name: u.meter.name(),
                        distributions: u.meter.distributions(),
                        curve: u.meter.curve_totals(),
                        output_tokens: u.meter.output_tokens_live(),
                        models: if shared.config.model_label {
                            u.meter.models()
                        } else {
                            Vec::new()
                        },
                    })
                    .collect();
                // Labelled tenants: those with the most output tokens, the rest `other`.
                let tenants = shared.tenants.config().any().then(|| {
                    let labels = shared.config.tenant_labels;
                    (shared.book).stats(std::time::Instant::now(), shared.config.window, labels)
                });
                let text = metrics::render(
                    &shared.telemetry,
                    &stats.upstreams,
                    &stats.connections,
                    &meters,
                    &self.live.process(),
                    (
                        shared.config.endpoint_labels,
                        tenants.as_deref(),
                        &stats.rollouts,
                    ),
                );
                respond(
                    StatusCode::OK,
                    "text/plain; version=0.0.4",
                    text.into_bytes(),
                )
            }
            "/auth" => {
                let body = serde_json::json!({
                    "token_required": shared.config.admin.token.is_some(),
                    "authorized": authorized(shared, req),
                });
                respond(StatusCode::OK, "application/json", body.to_string().into_bytes())
            }
            "/stats/history" => match self.history.document() {
                Ok(body) => respond(StatusCode::OK, "application/json", body),
                Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
            },
            "/rollout" => rollout::list(shared),
            // HEAD: the stream's head (GET streams from `events`).
            "/events" if req.method == http::Method::HEAD => {
                let mut resp = respond(StatusCode::OK, "text/event-stream", Vec::new());
                let headers = resp.headers_mut();
                headers.remove(http::header::CONTENT_LENGTH);
                headers.insert(http::header::CACHE_CONTROL, http::HeaderValue::from_static("no-store"));
                resp
            }
            "/healthz" => respond(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            "/readyz" => readiness(&self.live, shared),
            path if dashboard::is_static(path) => dashboard::serve(path),
            other => json_error(
                StatusCode::NOT_FOUND,
                &format!("no such endpoint: {other} (try /, /stats, /stats/history, /events, /metrics, /compare, /rollout, /healthz, /readyz)"),
            ),
        }
    }
}

/// Whether a `Host` (or an origin's authority) names the admin listener: its own address,
/// or `localhost`, at its port (an IP literal of any interface when it listens on all).
/// `/readyz`: 200 while tokentap takes traffic (its config loaded, its listeners up — this
/// answer is served by one — and every upstream with an endpoint taking requests); 503,
/// saying why, from the moment a drain begins, or while an upstream has none.
fn readiness(live: &Live, shared: &Shared) -> Response<Vec<u8>> {
    let why = if live.draining() {
        Some("draining: tokentap is shutting down".to_owned())
    } else {
        let down: Vec<&str> = (shared.upstreams.iter())
            .filter(|u| !u.pool.serving())
            .map(|u| u.config.name.as_str())
            .collect();
        (!down.is_empty()).then(|| format!("no healthy endpoint: {}", down.join(", ")))
    };
    match why {
        None => respond(StatusCode::OK, "text/plain", b"ready\n".to_vec()),
        Some(why) => respond(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            format!("not ready: {why}\n").into_bytes(),
        ),
    }
}

fn own_authority(authority: &str, admin: std::net::SocketAddr) -> bool {
    let Ok(parsed) = authority.parse::<http::uri::Authority>() else {
        return false;
    };
    let port = parsed.port_u16().unwrap_or(80);
    if port != admin.port() {
        return false;
    }
    let host = parsed.host().trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip == admin.ip() || admin.ip().is_unspecified())
}

/// Equal bytes, in time that depends on the lengths only.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::query::bounded;
    use super::*;

    #[test]
    fn own_authorities() {
        let admin: std::net::SocketAddr =
            "127.0.0.1:9191".parse().unwrap_or_else(|_| unreachable!());
        for ok in ["127.0.0.1:9191", "localhost:9191", "LOCALHOST:9191"] {
            assert!(own_authority(ok, admin), "{ok}");
        }
        for bad in [
            "evil.example:9191",
            "127.0.0.1:80",
            "127.0.0.2:9191",
            "localhost",
            "",
            "a b",
        ] {
            assert!(!own_authority(bad, admin), "{bad}");
        }
        let any: std::net::SocketAddr = "0.0.0.0:9191".parse().unwrap_or_else(|_| unreachable!());
        assert!(own_authority("10.1.2.3:9191", any));
        assert!(!own_authority("rebound.example:9191", any));
        let v6: std::net::SocketAddr = "[::1]:9191".parse().unwrap_or_else(|_| unreachable!());
        assert!(own_authority("[::1]:9191", v6));
    }

    #[test]
    fn client_text_is_quoted_back_bounded() {
        assert_eq!(bounded("vllm-a"), "vllm-a");
        let long = "é".repeat(7000);
        let quoted = bounded(&long);
        assert_eq!(quoted.chars().count(), 65, "64 characters and the ellipsis");
        assert!(quoted.ends_with('…'));
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
