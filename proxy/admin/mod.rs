//! The admin listener: `/stats` (JSON), `/metrics` (Prometheus), `/healthz`. It reads the
//! meter, never the proxy.

pub mod telemetry;

use std::sync::Arc;

use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use serde::Serialize;

use crate::meter::{SloStats, UpstreamStats};
use crate::server::{lock, Shared};

/// The `/stats` document (DESIGN §5).
#[derive(Debug, Serialize)]
pub struct Stats {
    pub window_secs: u64,
    pub upstreams: Vec<UpstreamStats>,
}

/// The admin HTTP app.
pub struct Admin {
    shared: Arc<Shared>,
}

// === impl Admin ===

impl Admin {
    pub fn new(shared: Arc<Shared>) -> Self {
        Admin { shared }
    }
}

/// The stats of every upstream, now.
pub fn stats(shared: &Shared) -> Stats {
    let now = shared.clock.now();
    Stats {
        window_secs: shared.config.window.as_secs(),
        upstreams: shared
            .meters
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mut s = m.stats(now);
                let l = shared.limiters[i].stats();
                s.limit = l.limit;
                s.queued = l.queued;
                s.rejected_total = l.rejected_queue_full + l.rejected_queue_timeout;
                s.rejected_by_reason = [
                    ("queue_full", l.rejected_queue_full),
                    ("queue_timeout", l.rejected_queue_timeout),
                ]
                .into_iter()
                .filter(|(_, n)| *n > 0)
                .collect();
                s.slo = shared.slo[i].as_ref().map(|st| {
                    let current = *lock(&st.current_tpot_ms);
                    SloStats {
                        tpot_ms: st.slo.tpot_ms,
                        percentile: st.slo.percentile,
                        met: current.map(|c| c <= st.slo.tpot_ms),
                        current_tpot_ms: current,
                        slo_bounded_system_tps: m
                            .slo_bounded_system_tps(st.slo.tpot_ms, st.slo.percentile),
                    }
                });
                s
            })
            .collect(),
    }
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

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let req = session.req_header();
        if req.method != http::Method::GET {
            return json_error(
                StatusCode::METHOD_NOT_ALLOWED,
                "the admin API is read-only: use GET",
            );
        }
        match req.uri.path() {
            "/stats" => match serde_json::to_vec_pretty(&stats(&self.shared)) {
                Ok(body) => respond(StatusCode::OK, "application/json", body),
                Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
            },
            "/metrics" => {
                let text = self.shared.telemetry.render(&stats(&self.shared).upstreams);
                respond(
                    StatusCode::OK,
                    "text/plain; version=0.0.4",
                    text.into_bytes(),
                )
            }
            "/healthz" => respond(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            other => json_error(
                StatusCode::NOT_FOUND,
                &format!("no such endpoint: {other} (try /stats, /metrics, /healthz)"),
            ),
        }
    }
}
