//! `[[upstream]]`: a backend (or a pool of replicas), its caps, timeouts and TLS, checked
//! and made the runtime's; its SLO, economics and pool have files of their own.

mod economics;
mod pool;
mod slo;

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::config::{
    tls, Balance, Problems, UpstreamConfig, DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_READ_TIMEOUT_SECS,
};
use crate::estimate::Estimate;
use crate::meter::Bound;
use crate::meter::Targets;
use economics::{economics, CapacityFile, ModelFile};
use pool::{discover, endpoints, health, DiscoverFile, HealthFile};
use slo::{slo, SloFile};

/// The default of `backend_scrape_ms`: how often a backend's own metrics are read.
pub(crate) const BACKEND_SCRAPE_MS: u64 = 1000;

/// The default of `eject_secs`: an ejection's first length.
pub(crate) const EJECT_SECS: u64 = 10;

/// The default of `eject_after`: failures in a row that eject an endpoint.
pub(crate) const EJECT_AFTER: u32 = 3;

/// The default of `max_queue`: requests waiting for a slot, at most.
pub(crate) const MAX_QUEUE: usize = 256;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamFile {
    /// Unique name: the `upstream` label everywhere. Required.
    #[serde(default)]
    pub name: String,
    /// `http://host:port` or `https://host[:port]`; no path. Required, unless `endpoints`
    /// or `discover` gives the upstream's endpoints.
    #[serde(default)]
    pub url: String,
    /// The replicas of one pool: `["http://10.0.0.1:8000", …]`, balanced, each with its own
    /// health and cap. Default: none.
    #[serde(default)]
    pub endpoints: Option<Vec<String>>,
    /// Endpoints found and followed live: `{ dns = "vllm.default.svc.cluster.local", port =
    /// 8000 }` (every A and AAAA record) or `{ file = "endpoints.txt" }` (one URL a line).
    /// Default: none.
    #[serde(default)]
    pub discover: Option<DiscoverFile>,
    /// Active health checks of each endpoint: `{ path = "/health" }`. Default: none.
    #[serde(default)]
    pub health: Option<HealthFile>,
    /// Consecutive failures that eject an endpoint: 5xx answers, no response head within
    /// `read_timeout_secs`, a body gone silent or cut by the upstream. Default 3.
    #[serde(default)]
    pub eject_after: Option<u32>,
    /// How long an endpoint is ejected, seconds: doubled while it keeps failing, at most
    /// 300. Default 10.
    #[serde(default)]
    pub eject_secs: Option<u64>,
    /// How a request picks an endpoint of the pool: "least_loaded", "round_robin" or
    /// "consistent_hash:header:NAME". Default "least_loaded".
    #[serde(default)]
    pub balance: Option<String>,
    /// A cap on the generation requests in flight across the whole pool. Default: none.
    #[serde(default)]
    pub max_concurrency_total: Option<u64>,
    /// Each endpoint's own Prometheus path (`/metrics`), scraped as `backend_metrics` is:
    /// the curve is bucketed by the batch of the endpoint that served each token, and
    /// `least_loaded` compares the backends' running + waiting. Default: none.
    #[serde(default)]
    pub backend_metrics_path: Option<String>,
    /// Static concurrency cap (with `[upstream.slo]`: the adaptive cap's ceiling).
    /// Default: none.
    #[serde(default)]
    pub max_concurrency: Option<u64>,
    /// Requests that may wait for a slot; more are refused with 429. Default 256.
    #[serde(default)]
    pub max_queue: Option<usize>,
    /// Longest wait for a slot, ms, before a 429. Default 30000.
    #[serde(default)]
    pub queue_timeout_ms: Option<u64>,
    /// Add `stream_options.include_usage` to streaming OpenAI requests that lack it (and
    /// take the usage chunk out of the response again), so counts are exact. Default false.
    #[serde(default)]
    pub inject_usage: bool,
    /// How tokens are estimated where the stream gives no exact count: "events" (one per
    /// token-bearing event) or "tokenizer" (the text through OpenAI's o200k BPE). Default
    /// "events".
    #[serde(default)]
    pub estimate: Estimate,
    /// Latency SLOs: each request judged good or not (goodput), and with `tpot_ms` an
    /// adaptive cap that holds it. Default: none.
    #[serde(default)]
    pub slo: Option<SloFile>,
    /// TCP (and TLS) connect timeout, ms. Default 5000.
    #[serde(default)]
    pub connect_timeout_ms: Option<u64>,
    /// Longest silence between two reads of a response, seconds. Default 300: prefill of a
    /// long prompt on a busy server can take minutes.
    #[serde(default)]
    pub read_timeout_secs: Option<u64>,
    /// Longest wait to write a request to the upstream, seconds. Default 60.
    #[serde(default)]
    pub write_timeout_secs: Option<u64>,
    /// How long an idle keep-alive connection to the upstream is kept, seconds. Default 60.
    #[serde(default)]
    pub idle_timeout_secs: Option<u64>,
    /// An https upstream: a PEM bundle of CA certificates trusted besides the platform's
    /// roots (a private CA). Default: none.
    #[serde(default)]
    pub ca_file: Option<String>,
    /// An https upstream: verify its certificate and name. `false` accepts any certificate
    /// (tokentap warns at start). Default true.
    #[serde(default)]
    pub tls_verify: Option<bool>,
    /// The backend's own Prometheus endpoint (`http://host:port/metrics`): its running and
    /// waiting requests and KV-cache use, and the curve bucketed by its batch. Default:
    /// none.
    #[serde(default)]
    pub backend_metrics: Option<String>,
    /// How often `backend_metrics` is scraped, ms. Default 1000.
    #[serde(default)]
    pub backend_scrape_ms: Option<u64>,
    /// The pool's price per hour, in any currency: its cost per million output tokens.
    /// Default: none.
    #[serde(default)]
    pub cost_per_hour: Option<f64>,
    /// The price's currency, as a label ("USD", "EUR"). Default: none.
    #[serde(default)]
    pub cost_currency: Option<String>,
    /// GPUs the price pays for: system T/s per GPU. Default: none.
    #[serde(default)]
    pub gpus: Option<u64>,
    /// The model's weights, `{ weight_gb = 70.6 }` or `{ params_b = 70.6, bytes_per_param
    /// = 1 }`: the decode roofline. Default: none.
    #[serde(default)]
    pub model: Option<ModelFile>,
    /// The GPU, for its HBM bandwidth: "h100-sxm", "h200", "b200", "a100-80gb", "l40s" or
    /// "mi300x". Default: none.
    #[serde(default)]
    pub gpu: Option<String>,
    /// One GPU's HBM bandwidth, TB/s (a GPU not in the table). Default: none.
    #[serde(default)]
    pub hbm_tb_per_s: Option<f64>,
    /// GPUs one replica's weights are split over. Default 1.
    #[serde(default)]
    pub tensor_parallel: Option<u64>,
    /// How many endpoints the demand needs: `{ headroom_pct = 20 }`. Default: none.
    #[serde(default)]
    pub capacity: Option<CapacityFile>,
}

/// `upstream[i]` checked (its name against the `earlier` ones', its addresses against
/// tokentap's own) and made the runtime's, or `None` with its problems added. Its URL is
/// resolved and its `ca_file` read here: the one check of a section that does I/O.
pub(super) fn upstream(
    i: usize,
    u: &UpstreamFile,
    earlier: &[UpstreamFile],
    (proxy, admin): (&Result<SocketAddr, ()>, &Result<SocketAddr, ()>),
    p: &mut Problems,
) -> Option<UpstreamConfig> {
    let at = |f: &str| format!("upstream[{i}].{f}");
    if u.name.is_empty() {
        p.add(
            at("name"),
            "is required: a name of its own, used in /stats and /metrics",
        );
    } else if let Some(j) = earlier.iter().position(|o| o.name == u.name) {
        p.add(
            at("name"),
            format!("`{}` is already the name of upstream[{j}]", u.name),
        );
    }
    if u.max_concurrency == Some(0) {
        p.add(at("max_concurrency"), "must be at least 1");
    }
    let (slo, targets, attainment_pct) = match &u.slo {
        Some(s) => slo(i, s, u.max_concurrency, p),
        None => (
            None,
            Targets::default(),
            crate::decide::DEFAULT_ATTAINMENT_PCT,
        ),
    };
    // Where a curve point stands within the SLO: its gaps against the TPOT SLO, and (with a
    // TTFT or e2e SLO, which gaps cannot show) its requests' attainment.
    let bound = u.slo.as_ref().filter(|_| targets.any()).map(|s| Bound {
        tpot_ms: targets.tpot_ms,
        percentile: s.percentile,
        attainment_pct: (targets.ttft_ms.is_some() || targets.e2e_ms.is_some())
            .then_some(attainment_pct),
    });
    let economics = economics(i, u, p);
    if u.max_queue.is_some_and(|q| q > 1_000_000) {
        p.add(at("max_queue"), "must be at most 1000000");
    }
    let positive = |p: &mut Problems, f: &str, v: Option<u64>, default: u64| {
        if v == Some(0) {
            p.add(at(f), "must be greater than 0");
        }
        v.unwrap_or(default)
    };
    let connect = positive(
        p,
        "connect_timeout_ms",
        u.connect_timeout_ms,
        DEFAULT_CONNECT_TIMEOUT_MS,
    );
    let read = positive(
        p,
        "read_timeout_secs",
        u.read_timeout_secs,
        DEFAULT_READ_TIMEOUT_SECS,
    );
    let write = positive(p, "write_timeout_secs", u.write_timeout_secs, 60);
    let idle = positive(p, "idle_timeout_secs", u.idle_timeout_secs, 60);
    let queue_timeout = positive(p, "queue_timeout_ms", u.queue_timeout_ms, 30_000);
    let endpoints = endpoints(i, u, (proxy, admin), p);
    let https = u.url.starts_with("https://")
        || u.endpoints
            .iter()
            .flatten()
            .any(|e| e.starts_with("https://"))
        || u.discover.as_ref().is_some_and(|d| d.file.is_some());
    if !https && (u.ca_file.is_some() || u.tls_verify.is_some()) {
        let key = if u.ca_file.is_some() {
            "ca_file"
        } else {
            "tls_verify"
        };
        p.add(at(key), "applies to an https:// upstream only");
    }
    let trust = match &u.ca_file {
        Some(path) if https => tls::trust_with(path)
            .map_err(|e| p.add(at("ca_file"), e))
            .ok(),
        _ => None,
    };
    let backend_metrics = u
        .backend_metrics
        .as_deref()
        .and_then(|m| match m.parse::<http::Uri>() {
            Ok(uri) if uri.scheme_str() == Some("http") && uri.host().is_some() => Some(uri),
            _ => {
                p.add(
                    at("backend_metrics"),
                    format!("must be an http:// URL like http://127.0.0.1:8000/metrics, not `{m}`"),
                );
                None
            }
        });
    let backend_scrape_ms = u.backend_scrape_ms.unwrap_or(BACKEND_SCRAPE_MS);
    if !(100..=60_000).contains(&backend_scrape_ms) {
        p.add(at("backend_scrape_ms"), "must be between 100 and 60000");
    }
    if u.backend_scrape_ms.is_some()
        && u.backend_metrics.is_none()
        && u.backend_metrics_path.is_none()
    {
        p.add(
            at("backend_scrape_ms"),
            "applies with backend_metrics or backend_metrics_path only",
        );
    }
    if let Some(path) = &u.backend_metrics_path {
        if u.backend_metrics.is_some() {
            p.add(
                at("backend_metrics_path"),
                "give backend_metrics (one URL) or backend_metrics_path (each endpoint's), not both",
            );
        } else if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
            p.add(
                at("backend_metrics_path"),
                format!("must be a path like /metrics, not `{path}`"),
            );
        }
    }
    let balance = match u.balance.as_deref().map(Balance::parse) {
        None => Balance::default(),
        Some(Ok(b)) => b,
        Some(Err(e)) => {
            p.add(at("balance"), e);
            Balance::default()
        }
    };
    if balance == Balance::SloHeadroom && targets.tpot_ms.is_none() && targets.ttft_ms.is_none() {
        p.add(
            at("balance"),
            "\"slo_headroom\" routes on the SLO: give slo.tpot_ms or slo.ttft_ms",
        );
    }
    if u.eject_after == Some(0) {
        p.add(at("eject_after"), "must be at least 1");
    }
    let eject_secs = u.eject_secs.unwrap_or(EJECT_SECS);
    if !(1..=300).contains(&eject_secs) {
        p.add(at("eject_secs"), "must be between 1 and 300");
    }
    if u.max_concurrency_total == Some(0) {
        p.add(at("max_concurrency_total"), "must be at least 1");
    }
    let health = u.health.as_ref().and_then(|h| health(i, h, p));
    let discover = u.discover.as_ref().and_then(|d| discover(i, d, p));
    let (endpoints, url) = endpoints?;
    Some(UpstreamConfig {
        name: u.name.clone(),
        url,
        endpoints,
        discover,
        health,
        eject_after: u.eject_after.unwrap_or(EJECT_AFTER).max(1),
        eject: Duration::from_secs(eject_secs),
        balance,
        max_concurrency_total: u.max_concurrency_total,
        backend_metrics_path: u.backend_metrics_path.clone(),
        connect_timeout: Duration::from_millis(connect),
        read_timeout: Duration::from_secs(read),
        write_timeout: Duration::from_secs(write),
        idle_timeout: Duration::from_secs(idle),
        max_concurrency: u.max_concurrency,
        max_queue: u.max_queue.unwrap_or(MAX_QUEUE),
        queue_timeout: Duration::from_millis(queue_timeout),
        slo,
        targets,
        attainment_pct,
        bound,
        economics,
        inject_usage: u.inject_usage,
        estimate: u.estimate,
        tls_verify: u.tls_verify.unwrap_or(true),
        ca_file: u.ca_file.clone(),
        trust,
        backend_metrics,
        backend_scrape: Duration::from_millis(backend_scrape_ms),
    })
}
