//! The admin listener: `/stats` (JSON), `/metrics` (Prometheus), `/healthz`. It reads the
//! meter, never the proxy.

pub mod metrics;

use std::collections::BTreeMap;

use std::sync::Arc;

use async_trait::async_trait;
use http::{Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use serde::Serialize;

use crate::compare::Comparison;
use crate::meter::MeterStats;
use crate::service::Transport;
use crate::state::{Shared, Upstream};

/// The `/stats` document (DESIGN §5).
#[derive(Debug, Serialize)]
pub struct Stats {
    pub window_secs: u64,
    pub connections: ConnectionStats,
    pub upstreams: Vec<UpstreamReport>,
}

/// One upstream in `/stats`: what its meter knows, with its limiter's and routes' parts.
#[derive(Debug, Clone, Serialize)]
pub struct UpstreamReport {
    #[serde(flatten)]
    pub meter: MeterStats,
    /// Requests waiting for a concurrency slot.
    pub queued: u64,
    /// The concurrency cap in force, `null` when there is none.
    pub limit: Option<u64>,
    /// Requests refused a slot (429), all reasons.
    pub rejected_total: u64,
    pub rejected_by_reason: BTreeMap<&'static str, u64>,
    /// The SLO the adaptive cap holds; `null` without one.
    pub slo: Option<SloStats>,
    /// The routes that send this upstream traffic, and its weight in each.
    pub arms: Vec<Arm>,
}

/// An upstream's place in one route's split.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Arm {
    /// The route's index in the config.
    pub route: usize,
    pub path_prefix: String,
    pub weight: u32,
    /// Its weight as a share of the route's total, percent.
    pub share_pct: f64,
}

/// How an upstream stands against its TPOT SLO.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SloStats {
    pub tpot_ms: f64,
    pub percentile: f64,
    /// Whether the last controller tick met the SLO; `null` before any traffic.
    pub met: Option<bool>,
    /// The SLO percentile of per-token gaps over the last controller tick.
    pub current_tpot_ms: Option<f64>,
    pub slo_bounded_system_tps: Option<f64>,
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
    transport: Arc<Transport>,
}

// === impl Admin ===

impl Admin {
    pub fn new(shared: Arc<Shared>, transport: Arc<Transport>) -> Self {
        Admin { shared, transport }
    }
}

/// The stats of every upstream, now.
pub fn stats(shared: &Shared, transport: &Transport) -> Stats {
    let now = shared.clock.now();
    let c = &transport.connections;
    Stats {
        window_secs: shared.config.window.as_secs(),
        connections: ConnectionStats {
            open: c.open(),
            max: c.max(),
            refused_total: c.refused(),
        },
        upstreams: shared
            .upstreams
            .iter()
            .enumerate()
            .map(|(i, u)| report(shared, i, u, now))
            .collect(),
    }
}

/// One upstream's part of `/stats`.
fn report(shared: &Shared, i: usize, u: &Upstream, now: crate::meter::Nanos) -> UpstreamReport {
    let l = u.limiter.stats();
    UpstreamReport {
        meter: u.meter.stats(now),
        queued: l.queued,
        limit: l.limit,
        rejected_total: l.rejected_queue_full + l.rejected_queue_timeout,
        rejected_by_reason: [
            ("queue_full", l.rejected_queue_full),
            ("queue_timeout", l.rejected_queue_timeout),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect(),
        slo: u.slo.as_ref().map(|a| {
            let current = a.current_tpot_ms();
            SloStats {
                tpot_ms: a.slo.tpot_ms,
                percentile: a.slo.percentile,
                met: current.map(|c| c <= a.slo.tpot_ms),
                current_tpot_ms: current,
                slo_bounded_system_tps: u
                    .meter
                    .slo_bounded_system_tps(a.slo.tpot_ms, a.slo.percentile),
            }
        }),
        arms: arms(shared, i),
    }
}

/// The routes that send `upstream` traffic, and its weight in each.
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
        shared
            .upstream(name)
            .map(|(i, _)| i)
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
    let (a, b) = (&shared.upstreams[a], &shared.upstreams[b]);
    Ok(crate::compare::compare(
        &a.config.name,
        &a.meter.samples(now),
        &b.config.name,
        &b.meter.samples(now),
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
            for u in &self.shared.upstreams {
                u.meter.reset_samples();
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
            "/stats" => match serde_json::to_vec_pretty(&stats(&self.shared, &self.transport)) {
                Ok(body) => respond(StatusCode::OK, "application/json", body),
                Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
            },
            "/metrics" => {
                let distributions: Vec<_> = self
                    .shared
                    .upstreams
                    .iter()
                    .map(|u| (u.meter.name(), u.meter.distributions()))
                    .collect();
                let stats = stats(&self.shared, &self.transport);
                let text = metrics::render(
                    &self.shared.telemetry,
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
