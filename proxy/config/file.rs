//! The config file as written: every struct rejects unknown keys, every field documents
//! its default.

use std::net::SocketAddr;
use std::time::Duration;

use http::header::HeaderName;
use indexmap::IndexMap;
use serde::Deserialize;

use super::{
    socket_addr, tls, AccessLog, AdminAuth, Balance, Cluster, Config, Discover, EndpointAddr,
    HealthCheck, Limits, Listen, ListenTls, Log, LogFormat, Mirror, Problem, Problems, Route,
    Secret, UpstreamConfig, ADMIN_TOKEN_ENV, DEFAULT_LOG_FILTER,
};
use super::{DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_READ_TIMEOUT_SECS};
use crate::decide::{Economics, Price, Roofline};
use crate::estimate::Estimate;
use crate::limit::controller::Slo;
use crate::meter::{Bound, Targets};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub listen: ListenFile,
    #[serde(default)]
    pub metrics: MetricsFile,
    #[serde(default)]
    pub server: ServerFile,
    #[serde(default)]
    pub compare: CompareFile,
    #[serde(default)]
    pub admin: AdminFile,
    #[serde(default)]
    pub log: LogFile,
    #[serde(default)]
    pub cluster: ClusterFile,
    #[serde(default)]
    pub upstream: Vec<UpstreamFile>,
    #[serde(default)]
    pub route: Vec<RouteFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ListenFile {
    /// Where clients connect. Default `127.0.0.1:8080`.
    pub proxy: String,
    /// The admin API (/stats, /metrics, /healthz). Default `127.0.0.1:9191` (Prometheus
    /// itself is on 9090): loopback, since
    /// it is unauthenticated.
    pub admin: String,
    /// A PEM certificate chain (leaf first): with `tls_key`, the proxy listener speaks
    /// TLS. Read again on reload. Default: none (plain TCP).
    pub tls_cert: Option<String>,
    /// The PEM private key of `tls_cert`.
    pub tls_key: Option<String>,
}

impl Default for ListenFile {
    fn default() -> Self {
        ListenFile {
            proxy: "127.0.0.1:8080".into(),
            admin: "127.0.0.1:9191".into(),
            tls_cert: None,
            tls_key: None,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogFile {
    /// A `RUST_LOG`-style filter, e.g. `"debug"` or `"info,tokentap=debug"`; the
    /// `RUST_LOG` environment variable wins when set. Default `info` for tokentap, `warn`
    /// for pingora.
    pub filter: Option<String>,
    /// `"text"` or `"json"` (one object per line); `--log-format` wins. Default "text".
    pub format: Option<String>,
    /// The access log, one JSON line per request: `"off"`, `"stdout"`, `"stderr"` or a file
    /// path (appended to, reopened on SIGUSR1). Default "off".
    pub access: Option<String>,
}

impl LogFile {
    fn log(&self, p: &mut Problems) -> Log {
        let filter = match &self.filter {
            Some(f) => match tracing_subscriber::EnvFilter::builder().parse(f) {
                Ok(_) => f.clone(),
                Err(e) => {
                    p.add("log.filter", format!("`{f}` is not a log filter: {e}"));
                    DEFAULT_LOG_FILTER.into()
                }
            },
            None => DEFAULT_LOG_FILTER.into(),
        };
        let format = match self.format.as_deref() {
            None | Some("text") => LogFormat::Text,
            Some("json") => LogFormat::Json,
            Some(other) => {
                p.add(
                    "log.format",
                    format!("must be \"text\" or \"json\", not `{other}`"),
                );
                LogFormat::Text
            }
        };
        let access = match self.access.as_deref() {
            None | Some("off") => AccessLog::Off,
            Some("stdout") => AccessLog::Stdout,
            Some("stderr") => AccessLog::Stderr,
            Some("") => {
                p.add(
                    "log.access",
                    "must be \"off\", \"stdout\", \"stderr\" or a file path",
                );
                AccessLog::Off
            }
            Some(path) => {
                // Opened (created) now, so that a path that cannot be written is a problem
                // of the file, not a silent gap in the log.
                let open = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path);
                if let Err(e) = open {
                    p.add(
                        "log.access",
                        format!("cannot open `{path}` for appending: {e}"),
                    );
                }
                AccessLog::File(path.into())
            }
        };
        Log {
            filter,
            format,
            access,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsFile {
    /// The sliding window of the live figures, seconds. Default 10.
    pub window_secs: u64,
    /// Largest SSE event metered, bytes; larger ones are forwarded and counted as unparsed.
    /// Default 1 MiB.
    pub max_event_bytes: usize,
    /// Count requests and output tokens per model (`tokentap_model_*`): the first 10
    /// models of each upstream get their name as the `model` label, later ones `other`.
    /// Default false.
    pub model_label: bool,
    /// How much recent time the concurrency→TPOT curve of `/stats` covers, seconds.
    /// Default 900.
    pub curve_window_secs: u64,
    /// Per-endpoint series on `/metrics` (an `endpoint` label) for pools of at most this
    /// many endpoints; a larger pool gets its pool series only. 0: none. Default 64.
    pub endpoint_labels: usize,
    /// The OpenTelemetry GenAI histograms too (`gen_ai_server_time_to_first_token_seconds`,
    /// `…_time_per_output_token_seconds`, `…_request_duration_seconds`,
    /// `gen_ai_client_token_usage`). Default false.
    pub semconv: bool,
}

impl Default for MetricsFile {
    fn default() -> Self {
        MetricsFile {
            window_secs: 10,
            max_event_bytes: 1 << 20,
            model_label: false,
            curve_window_secs: 900,
            endpoint_labels: 64,
            semconv: false,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterFile {
    /// `redis://host:port[/db]`: the caps (`max_concurrency`, the adaptive SLO cap) hold
    /// across every tokentap sharing it, as leases in Redis. Default: none (each replica
    /// caps alone).
    pub redis_url: Option<String>,
    /// How long a slot's lease lives unless renewed: a replica that dies frees its slots
    /// within this. Default 10.
    pub lease_secs: u64,
}

impl Default for ClusterFile {
    fn default() -> Self {
        ClusterFile {
            redis_url: None,
            lease_secs: 10,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminFile {
    /// A file holding the admin token: when set (or `TOKENTAP_ADMIN_TOKEN` is), every admin
    /// endpoint but `/healthz` needs `Authorization: Bearer TOKEN`. Default: none.
    pub token_file: Option<String>,
    /// `/metrics` answers without the token. Default false.
    pub metrics_public: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CompareFile {
    /// How far back `/compare` looks, seconds. Default 600.
    pub window_secs: u64,
}

impl Default for CompareFile {
    fn default() -> Self {
        CompareFile { window_secs: 600 }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerFile {
    /// Worker threads of the proxy. Default: the machine's cores.
    pub threads: Option<usize>,
    /// How long SIGTERM lets running streams finish, seconds. Default 30.
    pub grace_period_secs: Option<u64>,
    /// Idle upstream connections kept for reuse, across upstreams. Default 1024: with many
    /// long-lived streams, pingora's default of 128 would close most connections as streams
    /// end and open them again for the next request.
    pub upstream_keepalive_pool_size: Option<usize>,
    /// Let worker threads steal each other's connections. Default true.
    pub work_stealing: Option<bool>,
    /// A client that accepts no bytes of its response for this long is disconnected (its
    /// slot freed, its upstream request cancelled), seconds. Default 60.
    pub client_write_timeout_secs: Option<u64>,
    /// The whole request head must arrive within this, seconds, counted from its first
    /// byte; else 408. Default 30.
    pub request_head_timeout_secs: Option<u64>,
    /// The part of a request body read before the upstream is chosen (up to 64 KiB) must
    /// arrive within this, seconds, and then each read of the rest; else 408. Default 60.
    pub request_body_timeout_secs: Option<u64>,
    /// Larger request heads get 431 and are never buffered past this, bytes. Default 65536.
    pub max_request_head_bytes: Option<usize>,
    /// Open client connections beyond this are closed at once. Default: half the file
    /// descriptor limit (raised to its hard limit at start) less 64, since each client
    /// connection may hold an upstream connection too.
    pub max_connections: Option<usize>,
    /// Larger request bodies get 413, bytes. Default 33554432 (32 MiB).
    pub max_request_body_bytes: Option<u64>,
    /// An idle keep-alive client connection (its last response sent, no byte of the next
    /// request yet) is closed after this, seconds. Default 30.
    pub keepalive_timeout_secs: Option<u64>,
    /// Send the request id tokentap makes (a UUID, for a request that came without an
    /// `x-request-id`) upstream in `x-request-id`. Default true; false for a backend that
    /// wants nothing added (the client still gets the id).
    pub request_id_upstream: Option<bool>,
    /// Reload when the config file changes (its directory too: Kubernetes swaps a
    /// ConfigMap's `..data` symlink). Default true.
    pub watch_config: Option<bool>,
}

impl ListenFile {
    /// The proxy listener's TLS identity, loaded and checked.
    fn tls(&self, p: &mut Problems) -> Option<ListenTls> {
        match (&self.tls_cert, &self.tls_key) {
            (None, None) => None,
            (Some(_), None) => {
                p.add("listen.tls_key", "is needed with listen.tls_cert");
                None
            }
            (None, Some(_)) => {
                p.add("listen.tls_cert", "is needed with listen.tls_key");
                None
            }
            (Some(cert), Some(key)) => match tls::acceptor(cert, key) {
                Ok(acceptor) => Some(ListenTls {
                    cert: cert.clone(),
                    key: key.clone(),
                    acceptor,
                }),
                Err(e) => {
                    p.add("listen.tls_cert", e);
                    None
                }
            },
        }
    }
}

impl AdminFile {
    /// The admin token (the file's first line, else `TOKENTAP_ADMIN_TOKEN`), checked.
    fn auth(&self, p: &mut Problems) -> AdminAuth {
        let token = match &self.token_file {
            Some(path) => match std::fs::read_to_string(path) {
                Ok(text) => match text.lines().next().map(str::trim) {
                    Some(t) if !t.is_empty() => Some(Secret(t.to_owned())),
                    _ => {
                        p.add("admin.token_file", format!("`{path}` holds no token"));
                        None
                    }
                },
                Err(e) => {
                    p.add("admin.token_file", format!("cannot read `{path}`: {e}"));
                    None
                }
            },
            None => std::env::var(ADMIN_TOKEN_ENV)
                .ok()
                .map(|t| t.trim().to_owned())
                .filter(|t| !t.is_empty())
                .map(Secret),
        };
        AdminAuth {
            token,
            metrics_public: self.metrics_public,
        }
    }
}

impl ServerFile {
    /// The client-side limits, each checked.
    fn limits(&self, p: &mut Problems) -> Limits {
        let d = Limits::default();
        let secs = |p: &mut Problems, key: &str, v: Option<u64>, default: Duration| match v {
            Some(0) => {
                p.add(format!("server.{key}"), "must be at least 1");
                default
            }
            Some(s) => Duration::from_secs(s),
            None => default,
        };
        let client_write_timeout = secs(
            p,
            "client_write_timeout_secs",
            self.client_write_timeout_secs,
            d.client_write_timeout,
        );
        let request_head_timeout = secs(
            p,
            "request_head_timeout_secs",
            self.request_head_timeout_secs,
            d.request_head_timeout,
        );
        let request_body_timeout = secs(
            p,
            "request_body_timeout_secs",
            self.request_body_timeout_secs,
            d.request_body_timeout,
        );
        let keepalive_timeout = secs(
            p,
            "keepalive_timeout_secs",
            self.keepalive_timeout_secs,
            d.keepalive_timeout,
        );
        let max_request_head_bytes = match self.max_request_head_bytes {
            Some(n) if !(1024..=1 << 20).contains(&n) => {
                p.add(
                    "server.max_request_head_bytes",
                    "must be between 1024 and 1048576",
                );
                d.max_request_head_bytes
            }
            Some(n) => n,
            None => d.max_request_head_bytes,
        };
        if self.max_connections == Some(0) {
            p.add("server.max_connections", "must be at least 1");
        }
        if self.max_request_body_bytes == Some(0) {
            p.add("server.max_request_body_bytes", "must be at least 1");
        }
        Limits {
            client_write_timeout,
            request_head_timeout,
            request_body_timeout,
            keepalive_timeout,
            max_request_head_bytes,
            max_connections: self.max_connections.filter(|&n| n > 0),
            max_request_body_bytes: self
                .max_request_body_bytes
                .filter(|&n| n > 0)
                .unwrap_or(d.max_request_body_bytes),
        }
    }
}

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    /// The weights' size in GB (10⁹ bytes). Default: none.
    #[serde(default)]
    pub weight_gb: Option<f64>,
    /// Or the parameters, billions… Default: none.
    #[serde(default)]
    pub params_b: Option<f64>,
    /// …and the bytes each takes (2 for BF16, 1 for FP8, 0.5 for 4-bit). Default: none.
    #[serde(default)]
    pub bytes_per_param: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityFile {
    /// Demand is met with this much to spare, percent. Default 20.
    #[serde(default)]
    pub headroom_pct: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoverFile {
    /// A name whose A and AAAA records are the endpoints (a Kubernetes headless Service).
    /// Default: none.
    #[serde(default)]
    pub dns: Option<String>,
    /// The endpoints' port, with `dns`. Required with it.
    #[serde(default)]
    pub port: Option<u16>,
    /// `host:port` of the DNS server to ask, with `dns`. Default: the system's resolver.
    #[serde(default)]
    pub nameserver: Option<String>,
    /// A file of endpoint URLs, one a line (`#` comments), followed as it changes.
    /// Default: none.
    #[serde(default)]
    pub file: Option<String>,
    /// How often the name is resolved again, or the file read, seconds. Default 5.
    #[serde(default)]
    pub every_secs: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthFile {
    /// The path asked with GET; any 2xx is healthy. Default "/health".
    #[serde(default)]
    pub path: Option<String>,
    /// Seconds between two checks of an endpoint. Default 5.
    #[serde(default)]
    pub every_secs: Option<u64>,
    /// A check not answered within this fails, ms. Default 1000.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Consecutive failed checks that take an endpoint out. Default 2.
    #[serde(default)]
    pub unhealthy_after: Option<u32>,
    /// Consecutive good checks that bring it back (and end an ejection during which a check
    /// failed: a replica restarted). Default 1.
    #[serde(default)]
    pub healthy_after: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloFile {
    /// The TPOT to hold, ms: the adaptive cap steers on it, and each request's own TPOT is
    /// judged by it. Default: none.
    #[serde(default)]
    pub tpot_ms: Option<f64>,
    /// A request is good only with its TTFT at most this, ms. Default: none.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    /// …and its end-to-end latency at most this, ms. Default: none.
    #[serde(default)]
    pub e2e_ms: Option<f64>,
    /// The share of requests that must be good, percent: where a curve point stands
    /// within the SLO (with `ttft_ms` or `e2e_ms`). Default 90.
    #[serde(default)]
    pub attainment_pct: Option<f64>,
    /// Which percentile of per-token gaps must stay under it (1–99.9). Default 90.
    #[serde(default = "ninety")]
    pub percentile: f64,
    /// The adaptive cap never goes below this. Default 1.
    #[serde(default)]
    pub min_concurrency: Option<u64>,
    /// Nor above this. Default `max_concurrency` (the upstream's), else 1024.
    #[serde(default)]
    pub max_concurrency: Option<u64>,
}

fn ninety() -> f64 {
    90.0
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteFile {
    /// The route's name: the `route` label of its metrics, stable across edits of the
    /// file. Default: its `path_prefix` (`#2`, `#3`… added for later routes with the same).
    #[serde(default)]
    pub name: Option<String>,
    /// Requests whose path starts with this. Default `/`.
    #[serde(default = "slash")]
    pub path_prefix: String,
    /// Headers the request must carry with these exact values. Default: none.
    #[serde(default)]
    pub headers: IndexMap<String, String>,
    /// UpstreamConfig name → integer weight. Required.
    #[serde(default)]
    pub split: IndexMap<String, u32>,
    /// `header:NAME`: the same header value always lands on the same upstream.
    #[serde(default)]
    pub sticky: Option<String>,
    /// When the chosen upstream is at its cap, send the request to another upstream of
    /// the split that has headroom instead of queueing. Default false.
    #[serde(default)]
    pub spill: bool,
    /// Shadow traffic: a share of the route's generation requests sent to another upstream
    /// as well, metered, its answer discarded: `{ upstream = "candidate", percent = 10 }`,
    /// or a list of them. Default: none.
    #[serde(default)]
    pub mirror: Vec<MirrorFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MirrorFile {
    /// The upstream the copies go to. Required.
    #[serde(default)]
    pub upstream: String,
    /// The share of the route's generation requests mirrored, percent. Default 100.
    #[serde(default)]
    pub percent: Option<f64>,
    /// Copies in flight at once at most; more are skipped and counted. Default 16.
    #[serde(default)]
    pub max_in_flight: Option<u64>,
    /// Headers replaced (or added) on the copy, e.g. the candidate's own `Authorization`.
    /// Default: none.
    #[serde(default)]
    pub set_headers: IndexMap<String, String>,
    /// Cut the copy when its primary's client leaves. Default false: it runs to its end,
    /// so its measurement is whole.
    #[serde(default)]
    pub cancel_with_client: bool,
    /// `header:NAME`: the same header value is always mirrored or never (a conversation
    /// whole or not at all). Default: none (each request drawn on its own).
    #[serde(default)]
    pub sticky: Option<String>,
}

/// A route's default name: its path prefix, with `#2`, `#3`… when earlier routes took it.
fn unique_name(prefix: &str, earlier: &[Route]) -> String {
    let mut name = prefix.to_owned();
    let mut n = 1;
    while earlier.iter().any(|r| r.name == name) {
        n += 1;
        name = format!("{prefix}#{n}");
    }
    name
}

fn slash() -> String {
    "/".into()
}

// === impl FileConfig ===

impl FileConfig {
    /// Checks everything and builds the runtime config, or returns every problem found:
    /// small checks of one section each, composed; those that read files (certificates,
    /// the admin token, the access log, a CA bundle) or resolve names (upstream URLs) last.
    pub fn validate(self) -> Result<Config, Vec<Problem>> {
        let mut p = Problems::default();
        // The pure checks, each of its own section: …
        let (proxy, admin) = self.listen.addrs(&mut p);
        self.check_ranges(&mut p);
        let cluster = self.cluster.cluster(&mut p);
        if self.upstream.is_empty() {
            p.add("upstream", "at least one [[upstream]] is required");
        }

        let routes = self.routes(&mut p);
        let limits = self.server.limits(&mut p);
        // … then those that read files or resolve names.
        let addrs = (&proxy, &admin);
        let upstreams: Vec<UpstreamConfig> = (self.upstream.iter().enumerate())
            .filter_map(|(i, u)| upstream(i, u, &self.upstream[..i], addrs, &mut p))
            .collect();
        let admin_auth = self.admin.auth(&mut p);
        let log = self.log.log(&mut p);
        let listen_tls = self.listen.tls(&mut p);
        let threads = self
            .server
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
        let grace = self.server.grace_period_secs.unwrap_or(30);
        let keepalive_pool = self.server.upstream_keepalive_pool_size.unwrap_or(1024);
        let window = Duration::from_secs(self.metrics.window_secs);
        let max_event_bytes = self.metrics.max_event_bytes;
        let compare_window = Duration::from_secs(self.compare.window_secs);
        let model_label = self.metrics.model_label;
        let curve_window = Duration::from_secs(self.metrics.curve_window_secs);
        let endpoint_labels = self.metrics.endpoint_labels;
        let semconv = self.metrics.semconv;
        p.into_result(move || Config {
            listen: Listen {
                // Both are Ok here: an Err added a problem.
                proxy: proxy.unwrap_or_else(|_| unreachable!()),
                admin: admin.unwrap_or_else(|_| unreachable!()),
                tls: listen_tls,
            },
            window,
            compare_window,
            max_event_bytes,
            model_label,
            curve_window,
            endpoint_labels,
            semconv,
            cluster,
            threads,
            grace_period: Duration::from_secs(grace),
            keepalive_pool,
            work_stealing: self.server.work_stealing.unwrap_or(true),
            request_id_upstream: self.server.request_id_upstream.unwrap_or(true),
            watch_config: self.server.watch_config.unwrap_or(true),
            limits,
            admin: admin_auth,
            log,
            upstreams,
            routes,
        })
    }
}

impl FileConfig {
    /// The bounds of the global numbers (`metrics`, `compare`, `cluster.lease_secs`,
    /// `server.threads`).
    fn check_ranges(&self, p: &mut Problems) {
        if !(1..=3600).contains(&self.metrics.window_secs) {
            p.add("metrics.window_secs", "must be between 1 and 3600");
        }
        if !(10..=86_400).contains(&self.compare.window_secs) {
            p.add("compare.window_secs", "must be between 10 and 86400");
        }
        if !(3..=300).contains(&self.cluster.lease_secs) {
            p.add("cluster.lease_secs", "must be between 3 and 300");
        }
        if !(60..=86_400).contains(&self.metrics.curve_window_secs) {
            p.add("metrics.curve_window_secs", "must be between 60 and 86400");
        }
        if self.metrics.max_event_bytes < 1024 {
            p.add("metrics.max_event_bytes", "must be at least 1024");
        }
        if self.server.threads == Some(0) {
            p.add("server.threads", "must be at least 1");
        }
    }

    /// Every route checked against the upstreams' names; with none, one for `/` to the
    /// only upstream.
    fn routes(&self, p: &mut Problems) -> Vec<Route> {
        let index = |name: &str| self.upstream.iter().position(|u| u.name == name);
        let mut routes = Vec::new();
        for (i, r) in self.route.iter().enumerate() {
            let checked = route(i, r, &routes, index, p);
            routes.push(checked);
        }
        // A mirror takes copies only: its requests run outside any cap, so it must not
        // serve real clients on another route.
        for (i, r) in routes.iter().enumerate() {
            for (j, m) in r.mirrors.iter().enumerate() {
                let primary = |o: &Route| o.split.iter().any(|&(u, _)| u == m.upstream);
                if let Some(k) = routes.iter().position(primary) {
                    p.add(
                        format!("route[{i}].mirror[{j}].upstream"),
                        format!(
                            "`{}` is in route[{k}]'s split: a mirror serves copies only",
                            self.upstream[m.upstream].name
                        ),
                    );
                }
            }
        }
        if routes.is_empty() && self.upstream.len() > 1 {
            p.add(
                "route",
                "with more than one upstream, a [[route]] must say which gets what",
            );
        }
        if routes.is_empty() {
            routes.push(Route {
                name: "/".into(),
                path_prefix: "/".into(),
                headers: Vec::new(),
                split: vec![(0, 1)],
                sticky: None,
                spill: false,
                mirrors: Vec::new(),
            });
        }
        routes
    }
}

impl ListenFile {
    /// The proxy's and the admin's addresses, each its own.
    fn addrs(&self, p: &mut Problems) -> (Result<SocketAddr, ()>, Result<SocketAddr, ()>) {
        let proxy = socket_addr(&self.proxy).map_err(|e| p.add("listen.proxy", e));
        let admin = socket_addr(&self.admin).map_err(|e| p.add("listen.admin", e));
        if let (Ok(proxy), Ok(admin)) = (&proxy, &admin) {
            if proxy == admin {
                p.add(
                    "listen.admin",
                    format!("{admin} is listen.proxy's address too; give each its own"),
                );
            }
        }
        (proxy, admin)
    }
}

impl ClusterFile {
    /// `[cluster]`, when it names a Redis.
    fn cluster(&self, p: &mut Problems) -> Option<Cluster> {
        let url = self.redis_url.as_deref()?;
        match redis::Client::open(url) {
            Ok(_) if url.starts_with("redis://") => Some(Cluster {
                redis_url: url.to_owned(),
                lease: Duration::from_secs(self.lease_secs.clamp(3, 300)),
            }),
            _ => {
                p.add(
                    "cluster.redis_url",
                    format!("must be a URL like redis://127.0.0.1:6379, not `{url}`"),
                );
                None
            }
        }
    }
}

/// `upstream[i]` checked (its name against the `earlier` ones', its addresses against
/// tokentap's own) and made the runtime's, or `None` with its problems added. Its URL is
/// resolved and its `ca_file` read here: the one check of a section that does I/O.
fn upstream(
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
    let backend_scrape_ms = u.backend_scrape_ms.unwrap_or(1000);
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
    if u.eject_after == Some(0) {
        p.add(at("eject_after"), "must be at least 1");
    }
    let eject_secs = u.eject_secs.unwrap_or(10);
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
        eject_after: u.eject_after.unwrap_or(3).max(1),
        eject: Duration::from_secs(eject_secs),
        balance,
        max_concurrency_total: u.max_concurrency_total,
        backend_metrics_path: u.backend_metrics_path.clone(),
        connect_timeout: Duration::from_millis(connect),
        read_timeout: Duration::from_secs(read),
        write_timeout: Duration::from_secs(write),
        idle_timeout: Duration::from_secs(idle),
        max_concurrency: u.max_concurrency,
        max_queue: u.max_queue.unwrap_or(256),
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

/// `upstream[i].slo` checked: the adaptive cap's SLO (with `tpot_ms`), the targets each
/// request is judged by, and the attainment a curve point needs.
fn slo(
    i: usize,
    s: &SloFile,
    max_concurrency: Option<u64>,
    p: &mut Problems,
) -> (Option<Slo>, Targets, f64) {
    let at = |f: &str| format!("upstream[{i}].slo.{f}");
    let before = p.len();
    let mut ms = |key: &str, v: Option<f64>| {
        if let Some(v) = v.filter(|v| !(*v > 0.0 && v.is_finite())) {
            p.add(at(key), format!("must be a positive number of ms, not {v}"));
        }
    };
    ms("tpot_ms", s.tpot_ms);
    ms("ttft_ms", s.ttft_ms);
    ms("e2e_ms", s.e2e_ms);
    let targets = Targets {
        ttft_ms: s.ttft_ms,
        tpot_ms: s.tpot_ms,
        e2e_ms: s.e2e_ms,
    };
    if !targets.any() {
        p.add(
            format!("upstream[{i}].slo"),
            "give at least one of tpot_ms, ttft_ms and e2e_ms",
        );
    }
    let attainment = s
        .attainment_pct
        .unwrap_or(crate::decide::DEFAULT_ATTAINMENT_PCT);
    if !(attainment > 0.0 && attainment <= 100.0) {
        p.add(
            at("attainment_pct"),
            format!("must be above 0 and at most 100, not {attainment}"),
        );
    }
    if !(1.0..=99.9).contains(&s.percentile) {
        p.add(
            at("percentile"),
            format!("must be between 1 and 99.9, not {}", s.percentile),
        );
    }
    let min = s.min_concurrency.unwrap_or(1);
    let max = s.max_concurrency.or(max_concurrency).unwrap_or(1024);
    if s.tpot_ms.is_none() {
        for (key, given) in [
            ("min_concurrency", s.min_concurrency.is_some()),
            ("max_concurrency", s.max_concurrency.is_some()),
        ] {
            if given {
                p.add(at(key), "applies with tpot_ms (the adaptive cap) only");
            }
        }
    }
    if min == 0 {
        p.add(at("min_concurrency"), "must be at least 1");
    }
    if min > max {
        p.add(
            at("min_concurrency"),
            format!("{min} is above max_concurrency {max}"),
        );
    }
    let cap = s.tpot_ms.filter(|_| p.len() == before).map(|tpot_ms| Slo {
        tpot_ms,
        percentile: s.percentile,
        min_concurrency: min,
        max_concurrency: max,
    });
    (cap, targets, attainment)
}

/// The highest `cost_per_hour` taken: a billion an hour, in any currency.
const MAX_COST_PER_HOUR: f64 = 1e9;

/// `upstream[i]`'s price, model and GPUs, and its capacity's headroom, checked.
fn economics(i: usize, u: &UpstreamFile, p: &mut Problems) -> Economics {
    let at = |f: &str| format!("upstream[{i}].{f}");
    let positive = |p: &mut Problems, key: &str, v: Option<f64>, what: &str| {
        v.filter(|v| {
            let ok = *v > 0.0 && v.is_finite();
            if !ok {
                p.add(at(key), format!("must be a positive {what}, not {v}"));
            }
            ok
        })
    };
    // A price past this is a slip of the keyboard, and its figures would overflow to
    // nothing (1e308 per hour has no per-token cost an f64 can hold): refused.
    let per_hour = positive(p, "cost_per_hour", u.cost_per_hour, "price per hour").filter(|v| {
        let ok = *v <= MAX_COST_PER_HOUR;
        if !ok {
            p.add(
                at("cost_per_hour"),
                format!("{v:e} is not a price per hour (at most {MAX_COST_PER_HOUR:e})"),
            );
        }
        ok
    });
    if u.cost_per_hour.is_none() {
        for (key, given) in [
            ("cost_currency", u.cost_currency.is_some()),
            ("gpus", u.gpus.is_some()),
        ] {
            if given {
                p.add(at(key), "applies with cost_per_hour only");
            }
        }
    }
    if u.gpus == Some(0) {
        p.add(at("gpus"), "must be at least 1");
    }
    let price = per_hour.map(|per_hour| Price {
        per_hour,
        currency: u.cost_currency.clone(),
        gpus: u.gpus.map(|g| u32::try_from(g).unwrap_or(u32::MAX)),
    });
    let weight_gb = u.model.as_ref().and_then(|m| {
        let model = |f: &str| format!("upstream[{i}].model.{f}");
        match (m.weight_gb, m.params_b, m.bytes_per_param) {
            (Some(w), None, None) => positive(p, "model.weight_gb", Some(w), "size in GB"),
            (None, Some(params), Some(bytes)) => {
                let params = positive(p, "model.params_b", Some(params), "number of billions");
                let bytes = positive(p, "model.bytes_per_param", Some(bytes), "number of bytes");
                params.zip(bytes).map(|(n, b)| n * b)
            }
            (None, Some(_), None) => {
                p.add(
                    model("bytes_per_param"),
                    "is required with params_b: 2 for BF16, 1 for FP8, 0.5 for 4-bit",
                );
                None
            }
            (None, None, Some(_)) => {
                p.add(model("params_b"), "is required with bytes_per_param");
                None
            }
            (None, None, None) => {
                p.add(
                    at("model"),
                    "give weight_gb, or params_b and bytes_per_param",
                );
                None
            }
            (Some(_), ..) => {
                p.add(
                    model("weight_gb"),
                    "give weight_gb, or params_b and bytes_per_param, not both",
                );
                None
            }
        }
    });
    let bandwidth = match (&u.gpu, u.hbm_tb_per_s) {
        (Some(_), Some(_)) => {
            p.add(
                at("hbm_tb_per_s"),
                "give gpu (a known GPU) or hbm_tb_per_s, not both",
            );
            None
        }
        (Some(gpu), None) => crate::decide::gpu_bandwidth(gpu).or_else(|| {
            let known: Vec<&str> = crate::decide::GPUS.iter().map(|(n, _)| *n).collect();
            p.add(
                at("gpu"),
                format!(
                    "`{gpu}` is not one of {}; give hbm_tb_per_s for another GPU",
                    known.join(", ")
                ),
            );
            None
        }),
        (None, bw) => positive(p, "hbm_tb_per_s", bw, "bandwidth in TB/s"),
    };
    if u.tensor_parallel == Some(0) {
        p.add(at("tensor_parallel"), "must be at least 1");
    }
    let roofline_keys = [
        ("gpu", u.gpu.is_some()),
        ("hbm_tb_per_s", u.hbm_tb_per_s.is_some()),
        ("tensor_parallel", u.tensor_parallel.is_some()),
    ];
    if u.model.is_none() {
        for (key, _) in roofline_keys.iter().filter(|(_, given)| *given) {
            p.add(at(key), "applies with model (the decode roofline) only");
        }
    } else if u.gpu.is_none() && u.hbm_tb_per_s.is_none() {
        p.add(
            at("model"),
            "the roofline needs the GPU: gpu = \"h100-sxm\" (or another known one) or hbm_tb_per_s",
        );
    }
    let roofline = weight_gb
        .zip(bandwidth)
        .map(|(weight_gb, hbm_tb_per_s)| Roofline {
            weight_gb,
            hbm_tb_per_s,
            tensor_parallel: u
                .tensor_parallel
                .map_or(1, |t| u32::try_from(t.max(1)).unwrap_or(u32::MAX)),
            gpu: u.gpu.clone(),
        });
    let headroom_pct = match u.capacity.as_ref().and_then(|c| c.headroom_pct) {
        Some(h) if (0.0..=1000.0).contains(&h) => h,
        Some(h) => {
            p.add(
                at("capacity.headroom_pct"),
                format!("must be between 0 and 1000, not {h}"),
            );
            crate::decide::DEFAULT_HEADROOM_PCT
        }
        None => crate::decide::DEFAULT_HEADROOM_PCT,
    };
    Economics {
        price,
        roofline,
        headroom_pct,
    }
}

/// The endpoints `url` or `endpoints` give (exactly one of them, or `discover`), resolved,
/// none of them tokentap's own addresses; and `url` as written.
fn endpoints(
    i: usize,
    u: &UpstreamFile,
    (proxy, admin): (&Result<SocketAddr, ()>, &Result<SocketAddr, ()>),
    p: &mut Problems,
) -> Option<(Vec<EndpointAddr>, String)> {
    let at = |f: &str| format!("upstream[{i}].{f}");
    let given = [
        !u.url.is_empty(),
        u.endpoints.is_some(),
        u.discover.is_some(),
    ];
    match given.iter().filter(|&&g| g).count() {
        0 => {
            p.add(
                at("url"),
                "is required: http://host:port or https://host[:port] (or `endpoints`, or `discover`)",
            );
            return None;
        }
        1 => {}
        _ => {
            p.add(
                at("url"),
                "give one of url, endpoints and discover: they all say where the endpoints are",
            );
            return None;
        }
    }
    let urls: Vec<(String, &str)> = match &u.endpoints {
        Some(list) if list.is_empty() => {
            p.add(at("endpoints"), "is empty: give at least one URL");
            return None;
        }
        Some(list) => (list.iter().enumerate())
            .map(|(j, e)| (format!("upstream[{i}].endpoints[{j}]"), e.as_str()))
            .collect(),
        None if u.url.is_empty() => Vec::new(),
        None => vec![(at("url"), u.url.as_str())],
    };
    let before = p.len();
    let mut out: Vec<EndpointAddr> = Vec::new();
    for (path, url) in urls {
        match EndpointAddr::parse(url) {
            Ok(e) if proxy.as_ref().is_ok_and(|&l| l == e.addr) => p.add(
                path,
                format!(
                    "{} is tokentap's own listen.proxy: requests would loop",
                    e.addr
                ),
            ),
            Ok(e) if admin.as_ref().is_ok_and(|&l| l == e.addr) => {
                p.add(path, format!("{} is tokentap's own listen.admin", e.addr))
            }
            Ok(e) if out.iter().any(|o| o.addr == e.addr) => {
                p.add(path, format!("{} is listed twice", e.addr))
            }
            Ok(e) => out.push(e),
            Err(e) => p.add(path, e),
        }
    }
    (p.len() == before).then(|| (out, u.url.clone()))
}

fn discover(i: usize, d: &DiscoverFile, p: &mut Problems) -> Option<Discover> {
    let at = |f: &str| format!("upstream[{i}].discover.{f}");
    let every = d.every_secs.unwrap_or(5);
    if !(1..=3600).contains(&every) {
        p.add(at("every_secs"), "must be between 1 and 3600");
    }
    let every = Duration::from_secs(every);
    match (&d.dns, &d.file) {
        (Some(name), None) => {
            if name.is_empty() || name.contains(['/', ':', ' ']) {
                p.add(at("dns"), format!("`{name}` is not a DNS name"));
            }
            let port = d.port.filter(|&p| p > 0);
            if port.is_none() {
                p.add(at("port"), "is required with dns: the endpoints' port");
            }
            let nameserver = d.nameserver.as_deref().and_then(|n| {
                let with_port = if n.contains(':') {
                    n.to_owned()
                } else {
                    format!("{n}:53")
                };
                with_port
                    .parse::<SocketAddr>()
                    .map_err(|_| p.add(at("nameserver"), format!("must be an ip:port, not `{n}`")))
                    .ok()
            });
            Some(Discover::Dns {
                name: name.clone(),
                port: port?,
                nameserver,
                every,
            })
        }
        (None, Some(file)) => {
            if d.port.is_some() || d.nameserver.is_some() {
                let key = if d.port.is_some() {
                    "port"
                } else {
                    "nameserver"
                };
                p.add(
                    at(key),
                    "applies with dns only (each line of the file is a URL)",
                );
            }
            Some(Discover::File {
                path: file.into(),
                every,
            })
        }
        _ => {
            p.add(
                format!("upstream[{i}].discover"),
                "give dns (with port) or file",
            );
            None
        }
    }
}

fn health(i: usize, h: &HealthFile, p: &mut Problems) -> Option<HealthCheck> {
    let at = |f: &str| format!("upstream[{i}].health.{f}");
    let path = h.path.clone().unwrap_or_else(|| "/health".into());
    if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
        p.add(
            at("path"),
            format!("must be a path like /health, not `{path}`"),
        );
    }
    let every = h.every_secs.unwrap_or(5);
    if !(1..=3600).contains(&every) {
        p.add(at("every_secs"), "must be between 1 and 3600");
    }
    let timeout = h.timeout_ms.unwrap_or(1000);
    if !(10..=60_000).contains(&timeout) {
        p.add(at("timeout_ms"), "must be between 10 and 60000");
    }
    for (key, v) in [
        ("unhealthy_after", h.unhealthy_after),
        ("healthy_after", h.healthy_after),
    ] {
        if v == Some(0) {
            p.add(at(key), "must be at least 1");
        }
    }
    Some(HealthCheck {
        path,
        every: Duration::from_secs(every),
        timeout: Duration::from_millis(timeout),
        unhealthy_after: h.unhealthy_after.unwrap_or(2).max(1),
        healthy_after: h.healthy_after.unwrap_or(1).max(1),
    })
}

/// `route[i]` checked (its split against the upstreams' names, its name against the
/// `earlier` routes') and made the runtime's; its problems added.
fn route(
    i: usize,
    r: &RouteFile,
    earlier: &[Route],
    index: impl Fn(&str) -> Option<usize>,
    p: &mut Problems,
) -> Route {
    let at = |f: &str| format!("route[{i}].{f}");
    if !r.path_prefix.starts_with('/') {
        p.add(at("path_prefix"), "must start with `/`");
    }
    let mut headers = Vec::new();
    for (name, value) in &r.headers {
        match HeaderName::from_bytes(name.as_bytes()) {
            Ok(h) => headers.push((h, value.clone())),
            Err(_) => p.add(at(&format!("headers.{name}")), "not a valid header name"),
        }
    }
    if r.split.is_empty() {
        p.add(at("split"), "names no upstream");
    }
    let mut split = Vec::new();
    for (name, &weight) in &r.split {
        match index(name) {
            Some(u) => split.push((u, weight)),
            None => p.add(at(&format!("split.{name}")), "unknown upstream"),
        }
    }
    if !r.split.is_empty() && r.split.values().map(|&w| u64::from(w)).sum::<u64>() == 0 {
        p.add(at("split"), "total weight is 0");
    }
    let sticky = r
        .sticky
        .as_deref()
        .and_then(|s| header_key(s, &at("sticky"), p));
    let name = match &r.name {
        Some(n) if n.is_empty() || n.len() > 128 => {
            p.add(at("name"), "must be 1 to 128 characters");
            n.clone()
        }
        Some(n) if earlier.iter().any(|x: &Route| &x.name == n) => {
            p.add(at("name"), format!("another route is named `{n}`"));
            n.clone()
        }
        Some(n) => n.clone(),
        None => unique_name(&r.path_prefix, earlier),
    };
    let mirrors = r
        .mirror
        .iter()
        .enumerate()
        .filter_map(|(j, m)| mirror(&at(&format!("mirror[{j}]")), m, &split, &index, p))
        .collect();
    Route {
        name,
        path_prefix: r.path_prefix.clone(),
        headers,
        split,
        sticky,
        spill: r.spill,
        mirrors,
    }
}

/// One `route[i].mirror[j]` (`at`) checked: its upstream known and not one the route
/// splits to (a primary would be sent twice), its share and cap in range, its headers
/// valid.
fn mirror(
    at: &str,
    m: &MirrorFile,
    split: &[(usize, u32)],
    index: &impl Fn(&str) -> Option<usize>,
    p: &mut Problems,
) -> Option<Mirror> {
    let key = |f: &str| format!("{at}.{f}");
    let before = p.len();
    let upstream = match index(&m.upstream) {
        _ if m.upstream.is_empty() => {
            p.add(
                key("upstream"),
                "is required: the upstream the copies go to",
            );
            None
        }
        None => {
            p.add(
                key("upstream"),
                format!("unknown upstream `{}`", m.upstream),
            );
            None
        }
        Some(u) if split.iter().any(|&(s, _)| s == u) => {
            p.add(
                key("upstream"),
                format!(
                    "`{}` is in the route's split: a mirror is another upstream",
                    m.upstream
                ),
            );
            None
        }
        Some(u) => Some(u),
    };
    let percent = m.percent.unwrap_or(100.0);
    if !(percent > 0.0 && percent <= 100.0) {
        p.add(
            key("percent"),
            format!("must be above 0 and at most 100, not {percent}"),
        );
    }
    let max_in_flight = m.max_in_flight.unwrap_or(16);
    if max_in_flight == 0 {
        p.add(key("max_in_flight"), "must be at least 1");
    }
    let mut set_headers: Vec<(HeaderName, String)> = Vec::new();
    if m.set_headers.len() > 32 {
        p.add(key("set_headers"), "at most 32 headers");
    }
    for (name, value) in &m.set_headers {
        let at = key(&format!("set_headers.{name}"));
        match (
            HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_str(value),
        ) {
            (Ok(h), Ok(_)) if is_framing(&h) => p.add(at, "tokentap sets this one itself"),
            (Ok(h), Ok(_)) if set_headers.iter().any(|(o, _)| *o == h) => {
                p.add(at, "given twice (header names are not case-sensitive)")
            }
            (Ok(h), Ok(_)) => set_headers.push((h, value.clone())),
            _ => p.add(at, "not a valid header"),
        }
    }
    let sticky = m
        .sticky
        .as_deref()
        .and_then(|s| header_key(s, &key("sticky"), p));
    let upstream = upstream?;
    (p.len() == before).then_some(Mirror {
        upstream,
        percent,
        max_in_flight,
        set_headers,
        cancel_with_client: m.cancel_with_client,
        sticky,
    })
}

/// A `header:NAME` key (a route's or a mirror's `sticky`), or its problem at `at`.
fn header_key(s: &str, at: &str, p: &mut Problems) -> Option<HeaderName> {
    match s
        .strip_prefix("header:")
        .map(|h| HeaderName::from_bytes(h.trim().as_bytes()))
    {
        Some(Ok(h)) => Some(h),
        _ => {
            p.add(at, format!("must be `header:NAME`, not `{s}`"));
            None
        }
    }
}

/// Headers the upstream request's framing and routing take from tokentap, never a config.
fn is_framing(h: &HeaderName) -> bool {
    [
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "x-request-id",
    ]
    .contains(&h.as_str())
}
