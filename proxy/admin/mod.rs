//! The admin listener: the dashboard (`/`), `/stats` (JSON), `/stats/history`, `/events`
//! (server-sent snapshots), `/metrics` (Prometheus), `/compare`, `/healthz`. It reads the
//! meter, never the proxy.

mod dashboard;
pub mod history;
pub mod metrics;

use std::collections::BTreeMap;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use http::{Response, StatusCode};
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use serde::Serialize;

use history::History;

use crate::compare::Comparison;
use crate::meter::MeterStats;
use crate::service::Transport;
use crate::state::{Live, Shared, Upstream};

/// The `/stats` document (docs/admin-api.md).
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
    /// The latency SLOs and how the upstream stands against them; `null` without
    /// `[upstream.slo]`.
    pub slo: Option<SloStats>,
    /// Its cost per million output tokens, with `cost_per_hour`.
    pub cost: Option<crate::decide::CostStats>,
    /// The decode roofline and MBU, with `model` and a GPU.
    pub roofline: Option<crate::decide::RooflineStats>,
    /// The endpoints its demand needs at its SLO.
    pub capacity: crate::decide::CapacityStats,
    /// A route mirrors to it: its requests are copies (shadow traffic), metered, their
    /// answers discarded.
    pub mirror: bool,
    /// Its shadow traffic, as a mirror; `null` otherwise.
    pub shadow: Option<ShadowStats>,
    /// The routes that send this upstream traffic, and its weight in each.
    pub arms: Vec<Arm>,
    /// What the curve's concurrency axis counts: `"backend"` (its own running count, from
    /// `backend_metrics`) or `"proxy"` (this tokentap's in-flight requests).
    pub concurrency_source: &'static str,
    /// The backend's own load; `null` without `backend_metrics`.
    pub backend: Option<crate::backend::BackendStats>,
    /// How requests pick an endpoint of the pool.
    pub balance: String,
    /// Its endpoints (one for a `url`), each with its health, load and figures.
    pub endpoints: Vec<crate::pool::EndpointStats>,
}

/// An upstream's place in one route's split.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Arm {
    /// The route's name (`route[].name`, else its path prefix).
    pub route: String,
    pub path_prefix: String,
    pub weight: u32,
    /// Its weight as a share of the route's total, percent.
    pub share_pct: f64,
}

/// How an upstream stands against its latency SLOs.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SloStats {
    pub tpot_ms: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub percentile: f64,
    /// The share of requests that must be good.
    pub attainment_pct: f64,
    /// Whether the SLO holds now: the last controller tick's TPOT (with `tpot_ms`) and the
    /// window's attainment (once requests were judged); `null` before any traffic.
    pub met: Option<bool>,
    /// The SLO percentile of per-token gaps over the last controller tick (with `tpot_ms`).
    pub current_tpot_ms: Option<f64>,
    /// One endpoint's SLO-bounded system T/s: the highest among the curve's supported
    /// points within the SLO, and that point's concurrency.
    pub slo_bounded_system_tps: Option<f64>,
    pub slo_bounded_concurrency: Option<u64>,
    /// Who moves the limit: `local`, `fleet_leader`, `fleet_follower` or `degraded`;
    /// `null` without `tpot_ms` (no adaptive cap).
    pub controller: Option<&'static str>,
}

/// A mirror upstream's copies.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ShadowStats {
    /// Copies in flight now.
    pub in_flight: u64,
    /// Copies not sent, by reason: `max_in_flight`, `body_unread` (over the 64 KiB
    /// read-ahead), `no_endpoint`.
    pub skipped_total: BTreeMap<&'static str, u64>,
    /// Copies paired with their primary, by the primary's upstream (kept: the last 50,000).
    pub pairs: BTreeMap<String, usize>,
}

/// Client connections against `server.max_connections`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ConnectionStats {
    pub open: usize,
    pub max: usize,
    /// Closed at once because `max` were open (and none was idle).
    pub refused_total: u64,
    /// Idle between requests now.
    pub idle: usize,
    /// Idle keep-alive connections closed to make room for a new client at `max`.
    pub evicted_total: u64,
}

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
            idle: c.idle_now(),
            evicted_total: c.evicted(),
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
    let endpoints = u.pool.stats(now, shared.config.window);
    let meter = u.meter.stats(now);
    let bound = u.config.bound.and_then(|b| u.meter.slo_bound(&b));
    let endpoints_now = u.pool.counts(now).healthy;
    let economics = &u.config.economics;
    let capacity = crate::decide::capacity(
        crate::decide::Demand {
            system_tps: meter.system_tps,
            arrivals_per_sec: meter.arrivals_per_sec,
            mean_output_tokens: meter.mean_output_tokens,
            concurrency: meter.concurrency,
            queued: l.queued,
            endpoints_now,
        },
        bound,
        u.config.bound.is_some(),
        economics.headroom_pct,
    );
    // The pool's SLO-bounded rate: one endpoint's, on each endpoint taking requests.
    let pool_bounded = bound.map(|b| b.system_tps * endpoints_now.max(1) as f64);
    let lowest = meter
        .curve
        .iter()
        .filter(|p| !p.sparse)
        .find_map(|p| p.single_stream_tps.map(|tps| (p.concurrency, tps)));
    UpstreamReport {
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
        slo: u.config.bound.map(|b| {
            let t = &u.config.targets;
            let current = u.slo.as_ref().and_then(|a| a.current_tpot_ms());
            let tick = t.tpot_ms.zip(current).map(|(slo, c)| c <= slo);
            let attained = meter
                .goodput
                .and_then(|g| g.attainment_pct)
                .map(|a| a >= u.config.attainment_pct);
            SloStats {
                tpot_ms: t.tpot_ms,
                ttft_ms: t.ttft_ms,
                e2e_ms: t.e2e_ms,
                percentile: b.percentile,
                attainment_pct: u.config.attainment_pct,
                met: match (tick, attained) {
                    (None, None) => None,
                    (a, b) => Some(a.unwrap_or(true) && b.unwrap_or(true)),
                },
                current_tpot_ms: current,
                slo_bounded_system_tps: bound.map(|b| b.system_tps),
                slo_bounded_concurrency: bound.map(|b| b.concurrency),
                controller: u.slo.as_ref().map(|a| a.role().label()),
            }
        }),
        cost: economics
            .price
            .as_ref()
            .map(|p| p.stats(meter.system_tps, pool_bounded)),
        roofline: economics
            .roofline
            .as_ref()
            .map(|r| r.stats(lowest, meter.single_stream_tps)),
        capacity,
        mirror: is_mirror(shared, i),
        shadow: is_mirror(shared, i).then(|| {
            let s = &u.shadow;
            ShadowStats {
                in_flight: s.in_flight.load(Relaxed),
                skipped_total: [
                    ("max_in_flight", s.skipped_max_in_flight.load(Relaxed)),
                    ("body_unread", s.skipped_body_unread.load(Relaxed)),
                    ("no_endpoint", s.skipped_no_endpoint.load(Relaxed)),
                ]
                .into_iter()
                .collect(),
                pairs: s.pairs.counts(),
            }
        }),
        meter,
        arms: arms(shared, i),
        concurrency_source: if endpoints.iter().any(|e| {
            e.backend
                .as_ref()
                .is_some_and(|b| b.running.is_some() && b.age_ms.is_some())
        }) {
            // Each endpoint's own batch (`backend_metrics_path`) buckets its tokens.
            "backend"
        } else {
            u.meter.concurrency_source()
        },
        backend: u.backend.as_ref().map(|b| b.stats()),
        balance: match &u.config.balance {
            crate::config::Balance::LeastLoaded => "least_loaded".into(),
            crate::config::Balance::RoundRobin => "round_robin".into(),
            crate::config::Balance::ConsistentHash(h) => format!("consistent_hash:header:{h}"),
        },
        endpoints,
    }
}

/// Whether a route mirrors to `upstream`.
pub fn is_mirror(shared: &Shared, upstream: usize) -> bool {
    shared
        .config
        .routes
        .iter()
        .any(|r| r.mirrors.iter().any(|m| m.upstream == upstream))
}

/// The paired comparison of `a`'s requests with their copies on the mirror `b`, over the
/// compare window; `None` when `b` is no mirror of a route of `a`'s.
pub fn paired(
    shared: &Shared,
    a: usize,
    b: usize,
) -> Option<crate::compare::paired::PairedComparison> {
    let mirrors_a =
        shared.config.routes.iter().any(|r| {
            r.split.iter().any(|&(u, _)| u == a) && r.mirrors.iter().any(|m| m.upstream == b)
        });
    if !mirrors_a {
        return None;
    }
    let window = shared.config.compare_window;
    let since = shared
        .clock
        .now()
        .saturating_sub(u64::try_from(window.as_nanos()).unwrap_or(u64::MAX));
    let (a, b) = (&shared.upstreams[a], &shared.upstreams[b]);
    let pairs = b.shadow.pairs.of(&a.config.name, since);
    Some(crate::compare::paired::compare(
        &a.config.name,
        &b.config.name,
        &pairs,
        window.as_secs(),
    ))
}

/// The first mirror of the first route that has one, against the route's first arm.
pub fn default_paired(shared: &Shared) -> Option<crate::compare::paired::PairedComparison> {
    let (a, b) = shared.config.routes.iter().find_map(|r| {
        let m = r.mirrors.first()?;
        Some((r.split.first()?.0, m.upstream))
    })?;
    paired(shared, a, b)
}

/// The routes that send `upstream` traffic, and its weight in each.
fn arms(shared: &Shared, upstream: usize) -> Vec<Arm> {
    shared
        .config
        .routes
        .iter()
        .flat_map(|r| {
            let total: u64 = r.split.iter().map(|&(_, w)| u64::from(w)).sum();
            r.split
                .iter()
                .filter(move |&&(u, _)| u == upstream)
                .map(move |&(_, weight)| Arm {
                    route: r.name.clone(),
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

/// What a client sent, quoted back in an error: at most 64 characters (a whole query of
/// kilobytes is not echoed).
fn bounded(text: &str) -> std::borrow::Cow<'_, str> {
    const MAX: usize = 64;
    match text.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}…", &text[..cut]).into(),
        None => text.into(),
    }
}

/// The arms of a `/compare` query naming a primary and its mirror (either way round: the
/// primary as `a`), for the paired comparison.
fn paired_query(shared: &Shared, query: Option<&str>) -> Option<(usize, usize)> {
    let (mut a, mut b) = (None, None);
    for pair in query.unwrap_or("").split('&') {
        match pair.split_once('=') {
            Some(("a", v)) => a = shared.upstream(v).map(|(i, _)| i),
            Some(("b", v)) => b = shared.upstream(v).map(|(i, _)| i),
            _ => {}
        }
    }
    let (a, b) = (a?, b?);
    let mirrors = |p: usize, m: usize| {
        shared.config.routes.iter().any(|r| {
            r.split.iter().any(|&(u, _)| u == p) && r.mirrors.iter().any(|x| x.upstream == m)
        })
    };
    if mirrors(a, b) {
        Some((a, b))
    } else if mirrors(b, a) {
        Some((b, a))
    } else {
        None
    }
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
                    format!(
                        "unknown query parameter `{}`: use a=NAME&b=NAME",
                        bounded(pair)
                    ),
                ))
            }
        }
    }
    let config = &shared.config;
    let index = |name: &str| {
        shared.upstream(name).map(|(i, _)| i).ok_or_else(|| {
            let name = bounded(name);
            (StatusCode::NOT_FOUND, format!("no upstream named `{name}`"))
        })
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
    if a == b {
        let name = bounded(&shared.upstreams[a].config.name);
        return Err((
            StatusCode::BAD_REQUEST,
            format!("a and b are the same upstream (`{name}`): name two upstreams to compare"),
        ));
    }
    let now = shared.clock.now();
    let (a, b) = (&shared.upstreams[a], &shared.upstreams[b]);
    let price = |u: &Upstream| {
        u.config
            .economics
            .price
            .as_ref()
            .map(|p| crate::compare::ArmPrice {
                per_hour: p.per_hour,
                currency: p.currency.clone(),
                endpoints: u.pool.counts(now).healthy,
            })
    };
    Ok(crate::compare::compare(
        &a.config.name,
        &a.meter.samples(now),
        &b.config.name,
        &b.meter.samples(now),
        config.compare_window.as_secs(),
    )
    .priced(price(a).as_ref(), price(b).as_ref()))
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
        http.set_keepalive((!*shutdown.borrow()).then_some(60));
        let req = http.req_header();
        if req.method == http::Method::GET && req.uri.path() == "/events" {
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
        if req.method == http::Method::POST && req.uri.path() == "/reload" {
            return self.reload().await;
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
    let path = req.uri.path();
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
        if req.method == http::Method::POST && req.uri.path() == "/curve/reset" {
            for u in &shared.upstreams {
                u.meter.reset_curve();
            }
            return respond(
                StatusCode::OK,
                "application/json",
                br#"{"reset":true}"#.to_vec(),
            );
        }
        if req.method == http::Method::POST && req.uri.path() == "/compare/reset" {
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
                "use GET or HEAD (or POST /reload, POST /compare/reset, POST /curve/reset)",
            );
        }
        match req.uri.path() {
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
                let text = metrics::render(
                    &shared.telemetry,
                    &stats.upstreams,
                    &stats.connections,
                    &meters,
                    &self.live.process(),
                    shared.config.endpoint_labels,
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
            "/healthz" => respond(StatusCode::OK, "text/plain", b"ok\n".to_vec()),
            "/readyz" => readiness(&self.live, shared),
            path if dashboard::is_static(path) => dashboard::serve(path),
            other => json_error(
                StatusCode::NOT_FOUND,
                &format!("no such endpoint: {other} (try /, /stats, /stats/history, /events, /metrics, /compare, /healthz, /readyz)"),
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
