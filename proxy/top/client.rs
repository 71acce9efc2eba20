//! The admin API as `top` reads it: `/stats/history` once for the sparklines' past, then
//! `/events`, reconnecting every second while the tokentap is away. What it holds is a
//! [`Board`]: the latest snapshot, in the few fields the view draws.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::sync::watch;

/// Seconds of system T/s the sparklines show.
pub const SPARK_SECS: usize = 120;

/// Where the admin API is, and its token.
#[derive(Debug, Clone)]
pub struct Source {
    authority: String,
    token: Option<String>,
}

impl Source {
    /// `http://HOST:PORT` or `HOST:PORT`.
    pub fn parse(url: &str, token: Option<String>) -> anyhow::Result<Source> {
        if let Some(rest) = url.strip_prefix("https://") {
            anyhow::bail!("the admin API speaks plain HTTP: use http://{rest}");
        }
        let rest = url.strip_prefix("http://").unwrap_or(url);
        let authority = rest.trim_end_matches('/');
        let parsed: http::uri::Authority = authority
            .parse()
            .with_context(|| format!("`{url}` is not an address like http://127.0.0.1:9191"))?;
        let port = parsed.port_u16().unwrap_or(80);
        Ok(Source {
            authority: format!("{}:{port}", parsed.host()),
            token: token.filter(|t| !t.is_empty()),
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.authority)
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Pct {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct CurvePoint {
    pub concurrency: u64,
    pub tpot_ms_p50: Option<f64>,
    pub tpot_ms_p90: Option<f64>,
    pub system_tps: Option<f64>,
    pub samples: u64,
    #[serde(default)]
    pub sparse: bool,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct Slo {
    #[serde(default)]
    pub tpot_ms: Option<f64>,
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    #[serde(default)]
    pub e2e_ms: Option<f64>,
    pub percentile: f64,
    pub met: Option<bool>,
    /// What misses when it is not met (`ttft`, `tpot`, `e2e`, `error`).
    #[serde(default)]
    pub missed: Vec<String>,
    pub current_tpot_ms: Option<f64>,
}

/// What the figures decide, as `top` shows it (each part absent without its config).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct Goodput {
    pub requests_per_sec: Option<f64>,
    pub attainment_pct: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct Cost {
    pub currency: Option<String>,
    pub per_million_output_tokens: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct Roofline {
    pub mbu_pct: Option<f64>,
    pub problem: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct Capacity {
    pub endpoints_now: u64,
    pub endpoints_needed: Option<u64>,
    pub advice: Option<String>,
}

/// One upstream as the view draws it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct UpstreamView {
    pub name: String,
    pub in_flight: u64,
    #[serde(default)]
    pub queued: u64,
    #[serde(default)]
    pub limit: Option<u64>,
    pub concurrency: Option<f64>,
    pub single_stream_tps: Option<f64>,
    pub system_tps: Option<f64>,
    pub ttft_ms: Pct,
    pub tpot_ms: Pct,
    #[serde(default)]
    pub curve: Vec<CurvePoint>,
    #[serde(default)]
    pub slo: Option<Slo>,
    pub estimated_tokens_share_pct: Option<f64>,
    /// Prompt tokens the backend read from its prefix cache, percent, over the window
    /// (`null`: it does not say).
    #[serde(default)]
    pub cache_hit_rate_pct: Option<f64>,
    #[serde(default)]
    pub requests_total: u64,
    /// Its pool's endpoints.
    #[serde(default)]
    pub endpoints: Vec<EndpointView>,
    #[serde(default)]
    pub goodput: Option<Goodput>,
    #[serde(default)]
    pub cost: Option<Cost>,
    #[serde(default)]
    pub roofline: Option<Roofline>,
    #[serde(default)]
    pub capacity: Option<Capacity>,
}

/// One endpoint of a pool, as `top` shows it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct EndpointView {
    pub address: String,
    pub healthy: bool,
    #[serde(default)]
    pub health_checks_pass: bool,
    pub in_flight: u64,
    pub limit: Option<u64>,
    pub system_tps: Option<f64>,
}

/// One tenant (`[tenants]`), as `top` shows it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TenantView {
    pub tenant: String,
    pub output_share_pct: f64,
    pub output_tps: f64,
    pub ttft_ms: Pct,
    pub queue_wait_ms: f64,
    pub refused_total: u64,
}

/// A route's rollout, as `top` shows it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RolloutView {
    pub route: String,
    pub from: String,
    pub to: String,
    pub state: String,
    pub percent: f64,
    pub shadow_percent: f64,
    pub last: Option<LastEvaluation>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct LastEvaluation {
    pub decision: String,
    pub reason: String,
}

impl RolloutView {
    /// `chat: stable → candidate running at 10% (shadow 88.9%); wait: …`.
    pub fn line(&self) -> String {
        let mut out = format!(
            "{}: {} → {} {} at {}%",
            self.route,
            self.from,
            self.to,
            self.state.replace('_', " "),
            self.percent
        );
        if self.shadow_percent > 0.0 {
            out.push_str(&format!(" (shadow {}%)", self.shadow_percent));
        }
        if let Some(e) = &self.last {
            out.push_str(&format!("; {}: {}", e.decision.replace('_', " "), e.reason));
        }
        out
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
struct Tenants {
    top: Vec<TenantView>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct Stats {
    window_secs: u64,
    upstreams: Vec<UpstreamView>,
    #[serde(default)]
    tenants: Option<Tenants>,
    #[serde(default)]
    rollouts: Vec<RolloutView>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct Compare {
    verdict: String,
}

#[derive(Debug, Clone, Deserialize)]
struct PointUpstream {
    name: String,
    system_tps: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
struct Point {
    upstreams: Vec<PointUpstream>,
}

#[derive(Debug, Clone, Deserialize)]
struct Snapshot {
    t: u64,
    version: String,
    point: Point,
    stats: Stats,
    compare: Option<Compare>,
    #[serde(default)]
    shadow: Option<Compare>,
}

#[derive(Debug, Clone, Deserialize)]
struct History {
    points: Vec<Point>,
}

/// What the view draws: the latest snapshot, and each upstream's recent system T/s.
#[derive(Debug, Clone, Default)]
pub struct Board {
    /// The snapshot's Unix time, ms (0 before the first).
    pub t: u64,
    pub version: String,
    pub window_secs: u64,
    pub upstreams: Vec<UpstreamView>,
    /// The tenants with the most output tokens, with `[tenants]` (else none).
    pub tenants: Vec<TenantView>,
    /// Each route's rollout.
    pub rollouts: Vec<RolloutView>,
    /// The A/B verdict; `None` when no route splits traffic.
    pub verdict: Option<String>,
    /// The paired verdict of the first route's mirror (shadow traffic); `None` without.
    pub shadow: Option<String>,
    /// System T/s of the last [`SPARK_SECS`] seconds, by upstream.
    pub system_tps: BTreeMap<String, VecDeque<f64>>,
    /// Why there is no fresh data (connecting, refused, …).
    pub problem: Option<String>,
}

impl Board {
    fn remember(&mut self, point: &Point) {
        for u in &point.upstreams {
            let s = self.system_tps.entry(u.name.clone()).or_default();
            if s.len() == SPARK_SECS {
                s.pop_front();
            }
            s.push_back(u.system_tps.unwrap_or(0.0));
        }
    }
}

/// Watches `source`: a new board for every snapshot, and one saying why when it is away.
pub fn watch(source: Source) -> watch::Receiver<Arc<Board>> {
    let (tx, rx) = watch::channel(Arc::new(Board {
        problem: Some(format!("connecting to {}…", source.url())),
        ..Board::default()
    }));
    tokio::spawn(async move {
        loop {
            let why = follow(&source, &tx).await.err();
            let mut board = (**tx.borrow()).clone();
            board.problem = Some(match why {
                Some(e) => format!("{}: {e:#}; retrying", source.url()),
                None => format!("{}: the stream ended; retrying", source.url()),
            });
            if tx.send(Arc::new(board)).is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    rx
}

/// Reads the history, then every snapshot until the stream ends.
async fn follow(source: &Source, tx: &watch::Sender<Arc<Board>>) -> anyhow::Result<()> {
    let history: History = serde_json::from_slice(
        &get(source, "/stats/history")
            .await?
            .collect()
            .await?
            .to_bytes(),
    )
    .context("reading /stats/history")?;
    let mut board = Board::default();
    for p in history.points.iter().rev().take(SPARK_SECS).rev() {
        board.remember(p);
    }
    let mut body = get(source, "/events").await?;
    let mut buffer: Vec<u8> = Vec::new();
    // A snapshot comes every second: silence this long is a connection that died quietly.
    let silence = Duration::from_secs(5);
    while let Some(frame) = tokio::time::timeout(silence, body.frame())
        .await
        .map_err(|_| anyhow::anyhow!("no snapshot for 5 s"))?
    {
        let frame = frame.context("reading /events")?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buffer.extend_from_slice(&data);
        while let Some(end) = find(&buffer, b"\n\n") {
            let block: Vec<u8> = buffer.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&block);
            let data: String = text
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .collect();
            if data.is_empty() {
                continue;
            }
            let snap: Snapshot = serde_json::from_str(&data).context("a snapshot")?;
            board.remember(&snap.point);
            board.t = snap.t;
            board.version = snap.version;
            board.window_secs = snap.stats.window_secs;
            board.upstreams = snap.stats.upstreams;
            board.tenants = snap.stats.tenants.map(|t| t.top).unwrap_or_default();
            board.rollouts = snap.stats.rollouts;
            board.verdict = snap.compare.map(|c| c.verdict);
            board.shadow = snap.shadow.map(|c| c.verdict);
            board.problem = None;
            if tx.send(Arc::new(board.clone())).is_err() {
                return Ok(());
            }
        }
        // A snapshot is a few kB; a stream that never ends one is not tokentap's.
        anyhow::ensure!(buffer.len() < 16 << 20, "an /events message over 16 MiB");
    }
    Ok(())
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A GET of `path`: the response body once the status is 200.
async fn get(source: &Source, path: &str) -> anyhow::Result<hyper::body::Incoming> {
    let stream = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::net::TcpStream::connect(&source.authority),
    )
    .await
    .context("connecting timed out")?
    .context("cannot connect")?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut req = http::Request::builder()
        .uri(path)
        .header(http::header::HOST, &source.authority);
    if let Some(token) = &source.token {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let resp = tokio::time::timeout(
        Duration::from_secs(10),
        sender.send_request(req.body(Empty::<Bytes>::new())?),
    )
    .await
    .context("no answer")??;
    match resp.status().as_u16() {
        200 => Ok(resp.into_body()),
        401 => {
            anyhow::bail!("the admin API needs its token (--token-file, or TOKENTAP_ADMIN_TOKEN)")
        }
        404 => anyhow::bail!("{path} not found: is this a tokentap admin listener?"),
        s => anyhow::bail!("{path} answered {s}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        let s = Source::parse("http://127.0.0.1:9191/", None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.url(), "http://127.0.0.1:9191");
        let s = Source::parse("localhost:9", Some(String::new())).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((s.url().as_str(), s.token), ("http://localhost:9", None));
        assert!(Source::parse("https://x:1", None).is_err());
        assert!(Source::parse("not a url", None).is_err());
    }
}
