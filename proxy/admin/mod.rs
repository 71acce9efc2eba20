//! The admin listener: `/stats` (JSON), `/metrics` (Prometheus), `/healthz`. It reads the
//! meter, never the proxy.

pub mod telemetry;

use std::sync::Arc;

use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use serde::Serialize;

use crate::compare::Comparison;
use crate::meter::{Arm, SloStats, UpstreamStats};
use crate::server::{lock, Shared};

/// The `/stats` document (DESIGN §5).
#[derive(Debug, Serialize)]
pub struct Stats {
    pub window_secs: u64,
    pub connections: ConnectionStats,
    pub upstreams: Vec<UpstreamStats>,
}

/// Client connections against `server.max_connections`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ConnectionStats {
    pub open: usize,
    pub max: usize,
    /// Closed at once because `max` were open.
    pub refused_total: u64,
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
    let c = &shared.connections;
    Stats {
        window_secs: shared.config.window.as_secs(),
        connections: ConnectionStats {
            open: c.open(),
            max: c.max(),
            refused_total: c.refused(),
        },
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
                s.arms = arms(shared, i);
                s
            })
            .collect(),
    }
}

fn arms(shared: &Shared, upstream: usize) -> Vec<Arm> {
    shared
        .config
        .routes
        .iter()
        .enumerate()
        .flat_map(|(route, r)| {
            let total: u64 = r.split.iter().map(|&(_, w)| u64::from(w)).sum();
            r.split
                .iter()
                .filter(move |&&(u, _)| u == upstream)
                .map(move |&(_, weight)| Arm {
                    route,
                    path_prefix: r.path_prefix.clone(),
                    weight,
                    share_pct: if total > 0 {
                        100.0 * f64::from(weight) / total as f64
                    } else {
                        0.0
                    },
                })
        })
        .collect()
}

/// `/compare` for the query `a=NAME&b=NAME` (both optional: the first split's arms).
pub fn compare(shared: &Shared, query: Option<&str>) -> Result<Comparison, (StatusCode, String)> {
    let mut names = (None, None);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("a", v)) => names.0 = Some(v.to_owned()),
            Some(("b", v)) => names.1 = Some(v.to_owned()),
            _ => {
                return Err((
                    StatusCode::BAD_REQUEST,
                    format!("unknown query parameter `{pair}`: use a=NAME&b=NAME"),
                ))
            }
        }
    }
    let config = &shared.config;
    let index = |name: &str| {
        config
            .upstream_index(name)
            .ok_or_else(|| (StatusCode::NOT_FOUND, format!("no upstream named `{name}`")))
    };
    let default = config.default_pair();
    let a = match &names.0 {
        Some(n) => index(n)?,
        None => default.map(|d| d.0).ok_or((
            StatusCode::BAD_REQUEST,
            "no route splits traffic: name the arms, /compare?a=NAME&b=NAME".to_owned(),
        ))?,
    };
    let b = match &names.1 {
        Some(n) => index(n)?,
        None => default.map(|d| d.1).ok_or((
            StatusCode::BAD_REQUEST,
            "no route splits traffic: name the arms, /compare?a=NAME&b=NAME".to_owned(),
        ))?,
    };
    let now = shared.clock.now();
    Ok(crate::compare::compare(
        &config.upstreams[a].name,
        &shared.meters[a].samples(now),
        &config.upstreams[b].name,
        &shared.meters[b].samples(now),
        config.compare_window.as_secs(),
    ))
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
        if req.method == http::Method::POST && req.uri.path() == "/compare/reset" {
            for m in &self.shared.meters {
                m.reset_samples();
            }
            return respond(
                StatusCode::OK,
                "application/json",
                br#"{"reset":true}"#.to_vec(),
            );
        }
        if req.method != http::Method::GET {
            return json_error(
                StatusCode::METHOD_NOT_ALLOWED,
                "use GET (or POST /compare/reset)",
            );
        }
        match req.uri.path() {
            "/compare" => match compare(&self.shared, req.uri.query()) {
                Ok(c) => match serde_json::to_vec_pretty(&c) {
                    Ok(body) => respond(StatusCode::OK, "application/json", body),
                    Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
                },
                Err((status, message)) => json_error(status, &message),
            },
            "/stats" => match serde_json::to_vec_pretty(&stats(&self.shared)) {
                Ok(body) => respond(StatusCode::OK, "application/json", body),
                Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
            },
            "/metrics" => {
                let distributions: Vec<_> = self
                    .shared
                    .meters
                    .iter()
                    .map(|m| (m.name(), m.distributions()))
                    .collect();
                let stats = stats(&self.shared);
                let text = self.shared.telemetry.render(
                    &stats.upstreams,
                    &stats.connections,
                    &distributions,
                );
                respond(
                    StatusCode::OK,
                    "text/plain; version=0.0.4",
                    text.into_bytes(),
                )
            }
            "/healthz" => respond(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            other => json_error(
                StatusCode::NOT_FOUND,
                &format!("no such endpoint: {other} (try /stats, /metrics, /compare, /healthz)"),
            ),
        }
    }
}
