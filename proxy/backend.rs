//! What a backend says of its own load (`upstream[].backend_metrics`): its Prometheus
//! endpoint scraped every `backend_scrape_ms`, read for the running and waiting requests and
//! the KV-cache use, in whichever engine's names it exports (vLLM, SGLang, TGI, llama.cpp).
//!
//! The backend's running count is the truth the curve wants: N tokentap replicas in front
//! of one backend each see 1/N of its batch, but all of them read the same number here.
//! While it is fresh (younger than three scrape intervals) the meter buckets the curve by
//! it; otherwise by tokentap's own in-flight count. A scrape that fails is logged once
//! (until one succeeds again) and counted.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use serde::Serialize;

use crate::meter::UpstreamMeter;

/// The largest metrics page read (vLLM's is ~100 kB with histograms).
const MAX_PAGE: usize = 4 << 20;

/// The names of each figure, in the order they are looked for.
const RUNNING: &[&str] = &[
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
    "tgi_batch_current_size",
    "llamacpp:requests_processing",
];
const WAITING: &[&str] = &[
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "tgi_queue_size",
    "llamacpp:requests_deferred",
];
/// Fractions (0–1), shown as percent.
const KV_CACHE: &[&str] = &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"];

/// One scrape's figures; each `None` when the backend does not export it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Reading {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    pub kv_cache_pct: Option<f64>,
}

/// Reads a Prometheus text page: each figure summed over its series (vLLM labels them by
/// model), the first name found of each list.
pub fn parse(page: &str) -> Reading {
    let find = |names: &[&str]| -> Option<f64> {
        names.iter().find_map(|name| {
            let mut sum = None;
            for line in page.lines() {
                let Some(rest) = line.strip_prefix(name) else {
                    continue;
                };
                // `name{labels} value [timestamp]` or `name value`, not `name_suffix`.
                let rest = match rest.as_bytes().first() {
                    Some(b'{') => match rest.find('}') {
                        Some(end) => &rest[end + 1..],
                        None => continue,
                    },
                    Some(b' ') | Some(b'\t') => rest,
                    _ => continue,
                };
                if let Some(v) = rest
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .filter(|v| v.is_finite())
                {
                    sum = Some(sum.unwrap_or(0.0) + v);
                }
            }
            sum
        })
    };
    Reading {
        running: find(RUNNING),
        waiting: find(WAITING),
        kv_cache_pct: find(KV_CACHE).map(|f| f * 100.0),
    }
}

/// `/stats`' `backend`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BackendStats {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    pub kv_cache_pct: Option<f64>,
    /// Since the last successful scrape; `null` before one.
    pub age_ms: Option<u64>,
    pub scrape_failures_total: u64,
}

/// Who hears what a scrape read.
pub trait Sink: Send + Sync + 'static {
    fn reading(&self, backend: &Backend);
}

/// The upstream's meter buckets its curve by the backend's running count.
impl Sink for UpstreamMeter {
    fn reading(&self, backend: &Backend) {
        self.set_backend_running(backend.running());
    }
}

/// One upstream's backend load: the last good reading and how scrapes went.
pub struct Backend {
    url: http::Uri,
    interval: Duration,
    last: Mutex<Option<(Instant, Reading)>>,
    failures: AtomicU64,
    /// A failure was logged and no scrape has worked since.
    failing: std::sync::atomic::AtomicBool,
    scraping: std::sync::atomic::AtomicBool,
    next: Mutex<Instant>,
}

// === impl Backend ===

impl Backend {
    pub fn new(url: http::Uri, interval: Duration) -> Arc<Backend> {
        Arc::new(Backend {
            url,
            interval,
            last: Mutex::new(None),
            failures: AtomicU64::new(0),
            failing: Default::default(),
            scraping: Default::default(),
            next: Mutex::new(Instant::now()),
        })
    }

    /// Scrapes `path` (and query) every `interval`.
    pub fn scrapes(&self, path: &str, interval: Duration) -> bool {
        self.url.path_and_query().map(|p| p.as_str()) == Some(path) && self.interval == interval
    }

    /// The same endpoint and interval: a reload keeps its readings.
    pub fn same_as(&self, url: &http::Uri, interval: Duration) -> bool {
        &self.url == url && self.interval == interval
    }

    pub fn stats(&self) -> BackendStats {
        let last = *self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let reading = last.map(|(_, r)| r).unwrap_or_default();
        BackendStats {
            running: reading.running,
            waiting: reading.waiting,
            kv_cache_pct: reading.kv_cache_pct,
            age_ms: last.map(|(at, _)| u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX)),
            scrape_failures_total: self.failures.load(Relaxed),
        }
    }

    /// The running count while it is fresh: younger than three scrape intervals.
    pub fn running(&self) -> Option<u64> {
        let last = *self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let (at, r) = last?;
        (at.elapsed() < self.interval * 3)
            .then_some(r.running?)
            .map(|n| n.round().max(0.0) as u64)
    }

    /// Running + waiting while fresh: the load `least_loaded` compares.
    pub fn load(&self) -> Option<u64> {
        let last = *self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let (at, r) = last?;
        let n = r.running? + r.waiting.unwrap_or(0.0);
        (at.elapsed() < self.interval * 3).then_some(n.round().max(0.0) as u64)
    }

    /// Starts a scrape when one is due and none is running; tells `sink` (the upstream's
    /// meter, or one endpoint of its pool) what it reads.
    pub fn tick(self: &Arc<Self>, upstream: &str, sink: Arc<dyn Sink>) {
        sink.reading(self);
        let now = Instant::now();
        {
            let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
            if now < *next || self.scraping.swap(true, Relaxed) {
                return;
            }
            *next = now + self.interval;
        }
        let this = Arc::clone(self);
        let upstream = upstream.to_owned();
        tokio::spawn(async move {
            let timeout = this.interval.max(Duration::from_millis(500));
            let got = tokio::time::timeout(timeout, fetch(&this.url)).await;
            let got = got.unwrap_or_else(|_| Err(anyhow::anyhow!("no answer in {timeout:?}")));
            match got {
                Ok(page) => {
                    let reading = parse(&page);
                    *this.last.lock().unwrap_or_else(PoisonError::into_inner) =
                        Some((Instant::now(), reading));
                    if this.failing.swap(false, Relaxed) {
                        tracing::info!(upstream, url = %this.url, "backend metrics answer again");
                    }
                    if reading.running.is_none() && !this.failing.load(Relaxed) {
                        tracing::debug!(upstream, "backend metrics carry no running-request count");
                    }
                }
                Err(e) => {
                    this.failures.fetch_add(1, Relaxed);
                    if !this.failing.swap(true, Relaxed) {
                        tracing::warn!(
                            upstream,
                            url = %this.url,
                            cause = %format!("{e:#}"),
                            "backend metrics scrape failed; the curve uses tokentap's own in-flight count until it works"
                        );
                    }
                }
            }
            sink.reading(&this);
            this.scraping.store(false, Relaxed);
        });
    }
}

/// A GET of the metrics page.
async fn fetch(url: &http::Uri) -> anyhow::Result<String> {
    let host = url.host().context("no host")?;
    let port = url.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((host, port))
        .await
        .context("cannot connect")?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let path = url.path_and_query().map_or("/metrics", |p| p.as_str());
    let authority = url.authority().map_or(host, |a| a.as_str());
    let req = http::Request::builder()
        .uri(path)
        .header(http::header::HOST, authority)
        .header(http::header::ACCEPT, "text/plain")
        .body(Empty::<Bytes>::new())?;
    let resp = sender.send_request(req).await?;
    anyhow::ensure!(resp.status() == 200, "answered {}", resp.status());
    let body = Limited::new(resp.into_body(), MAX_PAGE)
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!("reading the page: {e}"))?
        .to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_engine_s_names() {
        let vllm = "# HELP vllm:num_requests_running Number of requests\n\
                    # TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{model_name=\"a\"} 12.0\n\
                    vllm:num_requests_running{model_name=\"b\"} 4.0\n\
                    vllm:num_requests_running_total 999\n\
                    vllm:num_requests_waiting{model_name=\"a\"} 3.0\n\
                    vllm:gpu_cache_usage_perc{model_name=\"a\"} 0.42\n";
        assert_eq!(
            parse(vllm),
            Reading {
                running: Some(16.0),
                waiting: Some(3.0),
                kv_cache_pct: Some(42.0)
            }
        );
        let sglang = "sglang:num_running_reqs{name=\"m\"} 7\nsglang:num_queue_reqs{name=\"m\"} 1\n";
        assert_eq!(parse(sglang).running, Some(7.0));
        assert_eq!(parse(sglang).waiting, Some(1.0));
        assert_eq!(
            parse("tgi_batch_current_size 5\ntgi_queue_size 2\n").running,
            Some(5.0)
        );
        let llama = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 9\n";
        assert_eq!(parse(llama).waiting, Some(9.0));
        assert_eq!(
            parse("something_else 1\nvllm:num_requests_running{x=\"1\"} NaN\n"),
            Reading::default()
        );
        assert_eq!(
            parse("vllm:num_requests_running{broken 3\n"),
            Reading::default()
        );
    }
}
