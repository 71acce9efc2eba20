//! Configuration: the TOML file's structs (unknown keys are errors), validated into the
//! runtime [`Config`] the proxy runs on. Validation reports every problem at once, each
//! with its dotted path (`route[1].split.vllm-b: unknown upstream`).

mod file;
mod schema;
mod tls;

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

use http::header::HeaderName;
use http::Uri;
use serde::Deserialize;

use crate::limit::controller::Slo;

pub use file::FileConfig;
pub use tls::Trust;

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: Listen,
    /// The sliding window of the live figures.
    pub window: Duration,
    /// How far back `/compare` looks.
    pub compare_window: Duration,
    /// Events larger than this are forwarded but not metered.
    pub max_event_bytes: usize,
    /// Per-model counters (`metrics.model_label`).
    pub model_label: bool,
    /// What the curve of `/stats` covers (`metrics.curve_window_secs`).
    pub curve_window: Duration,
    /// Pools of at most this many endpoints get per-endpoint series (`metrics.endpoint_labels`).
    pub endpoint_labels: usize,
    /// Tenants with a label of their own on `/metrics` (`metrics.tenant_labels`).
    pub tenant_labels: usize,
    /// The OpenTelemetry GenAI histograms too (`metrics.semconv`).
    pub semconv: bool,
    /// Who a request belongs to, its priority and budget (`[tenants]`).
    pub tenants: crate::tenant::TenantsConfig,
    /// Where the rollouts' state is kept across restarts (`rollouts.state_file`).
    pub rollout_state_file: Option<std::path::PathBuf>,
    /// Caps shared by every replica through Redis (`[cluster]`).
    pub cluster: Option<Cluster>,
    /// Worker threads of the proxy service.
    pub threads: usize,
    /// How long a graceful shutdown (SIGTERM) lets streams run on.
    pub grace_period: Duration,
    /// Idle upstream connections kept for reuse.
    pub keepalive_pool: usize,
    /// Work stealing between the proxy's worker threads.
    pub work_stealing: bool,
    /// The id tokentap makes for a request is sent upstream (`server.request_id_upstream`).
    pub request_id_upstream: bool,
    /// Reload when the config file changes (`server.watch_config`).
    pub watch_config: bool,
    /// What a client connection may take: time, head and body size, connections.
    pub limits: Limits,
    /// Who may use the admin API.
    pub admin: AdminAuth,
    /// What tokentap logs, and where requests are logged.
    pub log: Log,
    pub upstreams: Vec<UpstreamConfig>,
    /// Routes in file order; first match wins. Never empty: a config with one upstream and
    /// no route gets one route for `/` to it.
    pub routes: Vec<Route>,
}

/// `[cluster]`: where the fleet's leases live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    pub redis_url: String,
    pub lease: Duration,
}

/// The environment variable that holds the admin token when `admin.token_file` is unset.
pub const ADMIN_TOKEN_ENV: &str = "TOKENTAP_ADMIN_TOKEN";

/// Who may use the admin API (`[admin]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdminAuth {
    /// Every endpoint but `/healthz` (and `/metrics` when public) needs it as a bearer token.
    pub token: Option<Secret>,
    pub metrics_public: bool,
}

/// A value never printed (`Debug` shows `***`).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// The limits that hold against slow, huge and numerous clients (`[server]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A client that takes no response bytes for this long is disconnected.
    pub client_write_timeout: Duration,
    /// The whole request head must arrive within this of its first byte.
    pub request_head_timeout: Duration,
    /// The body's read-ahead must arrive within this, and then each read of the rest.
    pub request_body_timeout: Duration,
    /// An idle keep-alive client connection is closed after this.
    pub keepalive_timeout: Duration,
    /// Larger request heads get 431.
    pub max_request_head_bytes: usize,
    /// Open client connections beyond this are closed at once; `None`: derived from the
    /// file descriptor limit when the server starts.
    pub max_connections: Option<usize>,
    /// Larger request bodies get 413.
    pub max_request_body_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            client_write_timeout: Duration::from_secs(60),
            request_head_timeout: Duration::from_secs(30),
            request_body_timeout: Duration::from_secs(60),
            keepalive_timeout: Duration::from_secs(30),
            max_request_head_bytes: 64 * 1024,
            max_connections: None,
            max_request_body_bytes: 32 << 20,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Listen {
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    /// The proxy listener speaks TLS with this identity; `None`: plain TCP.
    pub tls: Option<ListenTls>,
}

/// The proxy listener's TLS identity (`listen.tls_cert`, `listen.tls_key`), loaded.
#[derive(Clone)]
pub struct ListenTls {
    pub cert: String,
    pub key: String,
    pub acceptor: std::sync::Arc<pingora::listeners::tls::Acceptor>,
}

impl fmt::Debug for ListenTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ListenTls")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// `[log]`: the log's filter and format, and the access log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Log {
    /// A `RUST_LOG`-style filter (`RUST_LOG` itself wins when set).
    pub filter: String,
    pub format: LogFormat,
    pub access: AccessLog,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Where the access log goes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum AccessLog {
    #[default]
    Off,
    Stdout,
    Stderr,
    /// Appended to this file, reopened on SIGUSR1.
    File(std::path::PathBuf),
}

impl Default for Log {
    fn default() -> Self {
        Log {
            filter: DEFAULT_LOG_FILTER.into(),
            format: LogFormat::Text,
            access: AccessLog::Off,
        }
    }
}

/// The log filter when neither `RUST_LOG` nor `log.filter` says otherwise: tokentap's own
/// lines at info, pingora's at warn (its info lines narrate every start and stop).
pub const DEFAULT_LOG_FILTER: &str = "info,pingora=warn,pingora_core=warn,pingora_proxy=warn";

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    pub name: String,
    /// `url` as written (empty when `endpoints` or `discover` gives the endpoints).
    pub url: String,
    /// The endpoints given in the file (`url` or `endpoints`), resolved when the config is
    /// loaded; empty with `discover`, which finds them while running.
    pub endpoints: Vec<EndpointAddr>,
    pub discover: Option<Discover>,
    pub health: Option<HealthCheck>,
    /// Consecutive 5xx answers that eject an endpoint.
    pub eject_after: u32,
    /// A first ejection's length (doubled while the endpoint keeps failing, at most 5 min).
    pub eject: Duration,
    pub balance: Balance,
    /// A cap on the whole pool's generation requests in flight.
    pub max_concurrency_total: Option<u64>,
    /// Each endpoint's own metrics path, scraped every `backend_scrape`.
    pub backend_metrics_path: Option<String>,
    pub connect_timeout: Duration,
    /// The longest silence tolerated between two reads of a response.
    pub read_timeout: Duration,
    pub write_timeout: Duration,
    /// How long an idle pooled connection is kept.
    pub idle_timeout: Duration,
    /// A static concurrency cap of each endpoint (the adaptive cap's ceiling when there is
    /// an SLO).
    pub max_concurrency: Option<u64>,
    /// Requests that may wait for a slot.
    pub max_queue: usize,
    pub queue_timeout: Duration,
    /// An adaptive cap that holds this SLO (`slo.tpot_ms`).
    pub slo: Option<Slo>,
    /// The latency SLOs each finished request is judged by (goodput); none set without
    /// `[upstream.slo]`.
    pub targets: crate::meter::Targets,
    /// The share of requests a curve point must keep good to count as within the SLO.
    pub attainment_pct: f64,
    /// What a curve point must meet to be within the SLO; none without `[upstream.slo]`.
    pub bound: Option<crate::meter::Bound>,
    /// Its price, model and GPUs, and the headroom its capacity keeps.
    pub economics: crate::decide::Economics,
    /// Ask streaming OpenAI requests for their usage chunk, and hide it again.
    pub inject_usage: bool,
    /// How tokens without an exact count are estimated.
    pub estimate: crate::estimate::Estimate,
    /// Verify an https upstream's certificate and name (`tls_verify`, default true).
    pub tls_verify: bool,
    /// `ca_file`, when given: the file, and the trust roots it makes (the platform's with
    /// the file's certificates added).
    pub ca_file: Option<String>,
    pub trust: Option<Trust>,
    /// The backend's Prometheus endpoint, scraped for its own load.
    pub backend_metrics: Option<http::Uri>,
    pub backend_scrape: Duration,
}

impl UpstreamConfig {
    /// Where its endpoints come from, for a log line: the URL, the list, the name or file.
    pub fn source(&self) -> String {
        match &self.discover {
            Some(Discover::Dns { name, port, .. }) => format!("dns {name}:{port}"),
            Some(Discover::File { path, .. }) => format!("file {}", path.display()),
            None if self.endpoints.len() == 1 => self.endpoints[0].url.clone(),
            None => format!("{} endpoints", self.endpoints.len()),
        }
    }
}

/// One endpoint of an upstream: where to connect, and how to name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointAddr {
    /// `scheme://host:port`, as `/stats` and the logs name it.
    pub url: String,
    pub addr: SocketAddr,
    pub tls: bool,
    /// `host[:port]` of the URL: sent as `Host`.
    pub host_header: String,
    /// The URL's host: sent as TLS SNI.
    pub sni: String,
}

impl EndpointAddr {
    /// The endpoint a URL names, its host resolved now (the first address).
    pub fn parse(url: &str) -> Result<EndpointAddr, String> {
        let (tls, host_header, sni, addr) = upstream_url(url)?;
        let scheme = if tls { "https" } else { "http" };
        Ok(EndpointAddr {
            url: format!("{scheme}://{host_header}"),
            addr,
            tls,
            host_header,
            sni,
        })
    }

    /// A plain-HTTP endpoint at `addr`, found under the name `host` (DNS discovery).
    pub fn found(host: &str, addr: SocketAddr) -> EndpointAddr {
        EndpointAddr {
            url: format!("http://{addr}"),
            addr,
            tls: false,
            host_header: format!("{host}:{}", addr.port()),
            sni: host.to_owned(),
        }
    }
}

/// Where a pool's endpoints are found while running (`discover`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Discover {
    /// Every A and AAAA record of `name`, at `port`, asked of `nameserver` (or the system's
    /// resolver) every `every`.
    Dns {
        name: String,
        port: u16,
        nameserver: Option<SocketAddr>,
        every: Duration,
    },
    /// One URL a line, read again every `every` when it changed.
    File {
        path: std::path::PathBuf,
        every: Duration,
    },
}

/// Active health checks (`health`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub path: String,
    pub every: Duration,
    pub timeout: Duration,
    pub unhealthy_after: u32,
    pub healthy_after: u32,
}

/// How a request picks an endpoint of its pool (`balance`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Balance {
    /// Power of two choices by load (in flight over the cap, or the backend's own running
    /// and waiting).
    #[default]
    LeastLoaded,
    RoundRobin,
    /// The same header value to the same endpoint while it is healthy and has room.
    ConsistentHash(HeaderName),
    /// The endpoint most likely to hold the prompt's prefix in its KV cache, by load bound.
    Prefix,
    /// The endpoint whose own curve predicts the most room under the upstream's SLO with
    /// one more request; with `slo.tpot_ms`, each endpoint's cap from its own curve.
    SloHeadroom,
}

impl Balance {
    pub fn parse(text: &str) -> Result<Balance, String> {
        match text {
            "least_loaded" => Ok(Balance::LeastLoaded),
            "round_robin" => Ok(Balance::RoundRobin),
            "prefix" => Ok(Balance::Prefix),
            "slo_headroom" => Ok(Balance::SloHeadroom),
            _ => match text.strip_prefix("consistent_hash:header:") {
                Some(name) => HeaderName::from_bytes(name.as_bytes())
                    .map(Balance::ConsistentHash)
                    .map_err(|_| format!("`{name}` is not a header name")),
                None => Err(format!(
                    "must be \"least_loaded\", \"round_robin\", \"prefix\", \"slo_headroom\" or \"consistent_hash:header:NAME\", not `{text}`"
                )),
            },
        }
    }
}

#[derive(Debug, Clone)]
pub struct Route {
    /// Its `name`, or its path prefix: the `route` label of its metrics.
    pub name: String,
    pub path_prefix: String,
    /// Headers that must be present with these exact values.
    pub headers: Vec<(HeaderName, String)>,
    /// (upstream index, weight), weights > 0 in total.
    pub split: Vec<(usize, u32)>,
    /// Requests carrying this header keep to one upstream per header value.
    pub sticky: Option<HeaderName>,
    /// Over-cap requests go to another upstream of the split with headroom.
    pub spill: bool,
    /// Upstreams a share of its generation requests is copied to (shadow traffic).
    pub mirrors: Vec<Mirror>,
    /// A progressive rollout between two upstreams of its split.
    pub rollout: Option<RolloutConfig>,
}

/// A route's rollout as configured (`route[].rollout`; run by [`crate::rollout`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutConfig {
    /// Upstreams of the route's split, by their place.
    pub from: usize,
    pub to: usize,
    pub steps: Vec<f64>,
    pub every: Duration,
    pub max_tpot_ratio: f64,
    pub max_ttft_ratio: Option<f64>,
    pub max_error_pct: f64,
    pub min_requests: u64,
}

/// A route's mirror: a share of its generation requests sent to another upstream as well,
/// metered there, the answer discarded.
#[derive(Debug, Clone)]
pub struct Mirror {
    pub upstream: usize,
    /// Percent of the route's generation requests.
    pub percent: f64,
    /// Copies in flight at once at most (per mirror upstream).
    pub max_in_flight: u64,
    /// Headers replaced or added on the copy.
    pub set_headers: Vec<(HeaderName, String)>,
    /// Cut the copy when its primary's client leaves.
    pub cancel_with_client: bool,
    /// Sampled by this header's value (a conversation whole or not at all).
    pub sticky: Option<HeaderName>,
}

/// One problem found in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub path: String,
    pub message: String,
    /// The line (from 1) of the key, when the file has it.
    pub line: Option<usize>,
}

impl fmt::Display for Problem {
    /// `route[0].split.ghost: unknown upstream (line 12)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&self.message)?;
        match self.line {
            Some(line) => write!(f, " (line {line})"),
            None => Ok(()),
        }
    }
}

/// Everything wrong with a config file.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    pub source_name: String,
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len();
        writeln!(
            f,
            "{}: {n} problem{}",
            self.source_name,
            if n == 1 { "" } else { "s" }
        )?;
        for p in &self.problems {
            writeln!(f, "  {p}")?;
        }
        Ok(())
    }
}

/// Default timeouts suited to LLM traffic: minutes-long generations are normal, and a
/// backend may think (prefill, queueing) for a long time before the first byte.
pub const DEFAULT_READ_TIMEOUT_SECS: u64 = 300;
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 5_000;

// === impl Config ===

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            source_name: name.clone(),
            problems: vec![Problem {
                path: String::new(),
                message: format!("cannot read: {e}"),
                line: None,
            }],
        })?;
        Config::parse(&text, &name)
    }

    /// Parses and validates config text; `source_name` names it in errors. Every problem
    /// is found in one pass: the document's shape (unknown keys, wrong types) is checked
    /// before it is read, each bad value taken out, and the rest validated; each problem
    /// carries its dotted path and line.
    pub fn parse(text: &str, source_name: &str) -> Result<Config, ConfigError> {
        let failed = |problems| ConfigError {
            source_name: source_name.to_owned(),
            problems,
        };
        let mut doc: toml::Table = toml::from_str(text).map_err(|e| {
            let (line, column) = e.span().map_or((0, 0), |s| line_column(text, s.start));
            failed(vec![Problem {
                path: String::new(),
                message: format!(
                    "not valid TOML at line {line}, column {column}: {}",
                    e.message()
                ),
                line: Some(line),
            }])
        })?;
        let mut p = Problems::default();
        let reported = schema::check(&mut doc, &mut p);
        let validated = match FileConfig::deserialize(toml::Value::Table(doc)) {
            Ok(file) => file.validate(),
            Err(e) => Err(vec![Problem {
                path: String::new(),
                message: e.message().to_owned(),
                line: None,
            }]),
        };
        let mut problems = p.0;
        match validated {
            Ok(config) if problems.is_empty() => return Ok(config),
            Ok(_) => {}
            // A value already reported for its type is not reported again as missing.
            Err(more) => problems.extend(more.into_iter().filter(|m| !reported.contains(&m.path))),
        }
        let lines = schema::lines(text);
        for problem in &mut problems {
            problem.line = problem.line.or_else(|| line_of(&lines, &problem.path));
        }
        // In the file's order; problems of the whole file last.
        problems.sort_by_key(|p| p.line.unwrap_or(usize::MAX));
        Err(failed(problems))
    }

    /// The default pair of `/compare`: the first two arms of the first route that splits.
    pub fn default_pair(&self) -> Option<(usize, usize)> {
        self.routes
            .iter()
            .find(|r| r.split.len() >= 2)
            .map(|r| (r.split[0].0, r.split[1].0))
    }
}

/// Collects problems during validation.
#[derive(Default)]
pub(crate) struct Problems(Vec<Problem>);

impl Problems {
    pub(crate) fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            path: path.into(),
            message: message.into(),
            line: None,
        });
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    pub(crate) fn into_result<T>(self, ok: impl FnOnce() -> T) -> Result<T, Vec<Problem>> {
        if self.0.is_empty() {
            Ok(ok())
        } else {
            Err(self.0)
        }
    }
}

/// The line of `path`, else of the nearest enclosing key the file has.
fn line_of(lines: &std::collections::HashMap<String, usize>, path: &str) -> Option<usize> {
    let mut at = path;
    loop {
        if let Some(&line) = lines.get(at) {
            return Some(line);
        }
        at = &at[..at.rfind(['.', '['])?];
    }
}

/// The line and column (from 1) of byte `offset` of `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

pub(crate) fn socket_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("`{s}` is not an address like 127.0.0.1:8080"))
}

/// An upstream URL's parts: (tls, host header, sni, resolved address).
pub(crate) fn upstream_url(url: &str) -> Result<(bool, String, String, SocketAddr), String> {
    let uri: Uri = url
        .parse()
        .map_err(|_| format!("`{url}` is not a URL like http://host:port"))?;
    let tls = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        Some(other) => return Err(format!("scheme `{other}` is not http or https")),
        None => return Err(format!("`{url}` has no scheme (http:// or https://)")),
    };
    let host = uri
        .host()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| format!("`{url}` has no host"))?;
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(format!(
            "`{url}` has a path; give scheme, host and port only (request paths pass through unchanged)"
        ));
    }
    let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let addr = (bare, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve `{host}`: {e}"))?
        .next()
        .ok_or_else(|| format!("`{host}` resolves to no address"))?;
    let host_header = match uri.port_u16() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_owned(),
    };
    Ok((tls, host_header, bare.to_owned(), addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(text: &str) -> Vec<String> {
        match Config::parse(text, "t.toml") {
            Ok(_) => vec![],
            Err(e) => e.problems.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn minimal_config_gets_defaults_and_an_implicit_route() {
        let c = Config::parse(
            "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:8000\"\n",
            "t",
        )
        .expect("valid");
        assert_eq!(c.listen.proxy.to_string(), "127.0.0.1:8080");
        assert_eq!(c.listen.admin.to_string(), "127.0.0.1:9191");
        assert_eq!(c.window, Duration::from_secs(10));
        assert_eq!(c.routes.len(), 1);
        assert_eq!(c.routes[0].split, vec![(0, 1)]);
        assert_eq!(c.upstreams[0].endpoints[0].host_header, "127.0.0.1:8000");
        assert_eq!(
            c.upstreams[0].read_timeout,
            Duration::from_secs(DEFAULT_READ_TIMEOUT_SECS)
        );
    }

    #[test]
    fn https_upstream_sends_its_host_as_sni() {
        let (tls, host, sni, _) = upstream_url("https://localhost").expect("valid");
        assert!(tls);
        assert_eq!((host.as_str(), sni.as_str()), ("localhost", "localhost"));
        let (_, _, _, addr) = upstream_url("https://localhost").expect("valid");
        assert_eq!(addr.port(), 443);
    }

    #[test]
    fn every_problem_is_reported_with_its_path() {
        let p = problems(
            r#"
[listen]
proxy = "nowhere"
[metrics]
window_secs = 0
[[upstream]]
name = "a"
url = "ftp://127.0.0.1:1"
[[upstream]]
name = "a"
url = "http://127.0.0.1:2/v1"
[[route]]
path_prefix = "/"
split = { "a" = 0, "ghost" = 5 }
sticky = "cookie:x"
[[route]]
path_prefix = "v1"
split = { "a" = 0 }
"#,
        );
        let want = [
            "listen.proxy: `nowhere` is not an address like 127.0.0.1:8080",
            "metrics.window_secs: must be between 1 and 3600",
            "upstream[0].url: scheme `ftp` is not http or https",
            "upstream[1].name: `a` is already the name of upstream[0]",
            "upstream[1].url: `http://127.0.0.1:2/v1` has a path",
            "route[0].split.ghost: unknown upstream",
            "route[0].sticky: must be `header:NAME`",
            "route[1].path_prefix: must start with `/`",
            "route[1].split: total weight is 0",
        ];
        for w in want {
            assert!(
                p.iter().any(|x| x.starts_with(w)),
                "missing {w:?} in {p:#?}"
            );
        }
    }

    #[test]
    fn server_limits_have_defaults_and_bounds() {
        let up = "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n";
        let c = Config::parse(up, "t").expect("valid");
        assert_eq!(c.limits, Limits::default());
        assert_eq!(c.limits.client_write_timeout, Duration::from_secs(60));
        assert_eq!(c.limits.keepalive_timeout, Duration::from_secs(30));
        assert!(c.request_id_upstream);
        assert_eq!(c.limits.max_request_head_bytes, 65536);
        assert_eq!(c.limits.max_request_body_bytes, 32 << 20);
        let p = problems(&format!(
            "[server]\nclient_write_timeout_secs = 0\nrequest_head_timeout_secs = 0\nrequest_body_timeout_secs = 0\nmax_request_head_bytes = 10\nmax_connections = 0\nmax_request_body_bytes = 0\nkeepalive_timeout_secs = 0\n{up}"
        ));
        for want in [
            "server.keepalive_timeout_secs: must be at least 1",
            "server.client_write_timeout_secs: must be at least 1",
            "server.request_head_timeout_secs: must be at least 1",
            "server.request_body_timeout_secs: must be at least 1",
            "server.max_request_head_bytes: must be between 1024 and 1048576",
            "server.max_connections: must be at least 1",
            "server.max_request_body_bytes: must be at least 1",
        ] {
            assert!(
                p.iter().any(|x| x.starts_with(want)),
                "missing {want:?} in {p:#?}"
            );
        }
        let c = Config::parse(&format!("[server]\nmax_connections = 7\n{up}"), "t").expect("valid");
        assert_eq!(c.limits.max_connections, Some(7));
    }

    #[test]
    fn unknown_keys_are_errors() {
        let p = problems("[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nweight = 3\n");
        assert_eq!(p.len(), 1);
        assert!(p[0].starts_with("upstream[0].weight: unknown key"), "{p:?}");
        assert!(p[0].ends_with("(line 4)"), "{p:?}");
    }

    #[test]
    fn wrong_types_misspellings_and_the_rest_are_reported_together() {
        let p = problems(
            "[listen]\nproxy = \"127.0.0.1:7000\"\nadmin = \"127.0.0.1:7000\"\n\
             [[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nread_timout_secs = 5\n\
             write_timeout_secs = \"ten\"\nmax_queue = -1\n\
             [[upstream]]\nname = \"b\"\nurl = \"htp:/nowhere\"\n\
             [[route]]\nsplit = { a = 1, ghost = 1 }\nspill = \"yes\"\n",
        );
        let want = [
            "listen.admin: 127.0.0.1:7000 is listen.proxy's address too; give each its own (line 3)",
            "upstream[0].read_timout_secs: unknown key; did you mean `read_timeout_secs`? (line 7)",
            "upstream[0].write_timeout_secs: must be a whole number of seconds, not the text \"ten\" (line 8)",
            "upstream[0].max_queue: must be a whole number, not -1 (line 9)",
            "upstream[1].url:",
            "route[0].split.ghost: unknown upstream (line 14)",
            "route[0].spill: must be true or false, not the text \"yes\" (line 15)",
        ];
        for w in want {
            assert!(
                p.iter().any(|x| x.starts_with(w)),
                "missing {w:?} in {p:#?}"
            );
        }
        assert_eq!(p.len(), want.len(), "{p:#?}");
    }

    #[test]
    fn a_syntax_error_names_its_line_and_column() {
        let p = problems("[listen]\nproxy = \"127.0.0.1:1\"\nadmin = 127.0.0.1:2\n");
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].starts_with("not valid TOML at line 3, column"),
            "{p:?}"
        );
    }

    #[test]
    fn an_upstream_at_tokentaps_own_address_is_a_loop() {
        let p = problems(
            "[listen]\nproxy = \"127.0.0.1:7001\"\n[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:7001\"\n",
        );
        assert!(
            p.iter()
                .any(|x| x
                    .starts_with("upstream[0].url: 127.0.0.1:7001 is tokentap's own listen.proxy")),
            "{p:?}"
        );
    }

    #[test]
    fn several_upstreams_need_a_route() {
        let p = problems(
            "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n[[upstream]]\nname = \"b\"\nurl = \"http://127.0.0.1:2\"\n",
        );
        assert!(p.iter().any(|x| x.starts_with("route: ")), "{p:?}");
        assert!(!problems("").is_empty(), "no upstream at all is an error");
    }

    #[test]
    fn slo_problems_have_paths() {
        let p = problems(
            "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nqueue_timeout_ms = 0\n[upstream.slo]\ntpot_ms = -3\npercentile = 100\nmin_concurrency = 50\nmax_concurrency = 10\n",
        );
        for want in [
            "upstream[0].slo.tpot_ms: must be a positive number",
            "upstream[0].slo.percentile: must be between 1 and 99.9",
            "upstream[0].slo.min_concurrency: 50 is above max_concurrency 10",
            "upstream[0].queue_timeout_ms: must be greater than 0",
        ] {
            assert!(
                p.iter().any(|x| x.starts_with(want)),
                "missing {want:?} in {p:#?}"
            );
        }
        let c = Config::parse(
            "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nmax_concurrency = 200\n[upstream.slo]\ntpot_ms = 30\n",
            "t",
        )
        .expect("valid");
        let slo = c.upstreams[0].slo.expect("slo");
        assert_eq!(
            (slo.percentile, slo.min_concurrency, slo.max_concurrency),
            (90.0, 1, 200)
        );
    }

    /// The decisions' keys: latency SLOs without a cap, a price, a model on its GPUs.
    #[test]
    fn decisions_keys_are_read_and_their_mistakes_reported() {
        let c = Config::parse(
            concat!(
                "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n",
                "cost_per_hour = 2.5\ncost_currency = \"USD\"\ngpus = 1\n",
                "model = { params_b = 70.6, bytes_per_param = 1 }\ngpu = \"h100-sxm\"\n",
                "capacity = { headroom_pct = 30 }\n",
                "[upstream.slo]\nttft_ms = 500\ne2e_ms = 20000\n",
            ),
            "t",
        )
        .expect("valid");
        let u = &c.upstreams[0];
        assert!(u.slo.is_none(), "no tpot_ms, no adaptive cap");
        assert_eq!(
            (u.targets.ttft_ms, u.targets.tpot_ms, u.targets.e2e_ms),
            (Some(500.0), None, Some(20000.0))
        );
        assert_eq!(
            u.bound.map(|b| b.attainment_pct),
            Some(Some(90.0)),
            "a TTFT SLO is judged on requests"
        );
        let r = u.economics.roofline.as_ref().expect("a roofline");
        assert!((r.single_stream_ceiling_tps() - 47.45).abs() < 0.01);
        assert_eq!(u.economics.price.as_ref().map(|p| p.per_hour), Some(2.5));
        assert_eq!(u.economics.headroom_pct, 30.0);

        let p = problems(concat!(
            "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n",
            "cost_per_hour = -1\nmodel = { params_b = 8 }\ngpu = \"h100\"\ntensor_parallel = 0\n",
            "capacity = { headroom_pct = -5 }\n",
            "[upstream.slo]\nmin_concurrency = 4\nattainment_pct = 0\n",
            "[[upstream]]\nname = \"b\"\nurl = \"http://127.0.0.1:2\"\ngpus = 2\ngpu = \"h200\"\n",
            "model = { weight_gb = 16 }\nhbm_tb_per_s = 4.8\n",
            "[[route]]\nsplit = { a = 1, b = 1 }\n",
            "[[upstream]]\nname = \"c\"\nurl = \"http://127.0.0.1:3\"\ncost_per_hour = 1e308\n",
        ));
        for want in [
            "upstream[0].cost_per_hour: must be a positive price per hour",
            "upstream[2].cost_per_hour: 1e308 is not a price per hour (at most 1e9)",
            "upstream[0].model.bytes_per_param: is required with params_b",
            "upstream[0].gpu: `h100` is not one of h100-sxm, h200",
            "upstream[0].tensor_parallel: must be at least 1",
            "upstream[0].capacity.headroom_pct: must be between 0 and 1000",
            "upstream[0].slo: give at least one of tpot_ms, ttft_ms and e2e_ms",
            "upstream[0].slo.min_concurrency: applies with tpot_ms",
            "upstream[0].slo.attainment_pct: must be above 0",
            "upstream[1].gpus: applies with cost_per_hour only",
            "upstream[1].hbm_tb_per_s: give gpu (a known GPU) or hbm_tb_per_s, not both",
        ] {
            assert!(
                p.iter().any(|x| x.starts_with(want)),
                "missing {want:?} in {p:#?}"
            );
        }
    }

    /// `route[].mirror`: one table or a list, each checked.
    #[test]
    fn mirrors_are_read_and_their_mistakes_reported() {
        let two = "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n\
                   [[upstream]]\nname = \"b\"\nurl = \"http://127.0.0.1:2\"\n";
        let c = Config::parse(
            &format!(
                "{two}[[route]]\nsplit = {{ a = 1 }}\n\
                 mirror = {{ upstream = \"b\", percent = 20, sticky = \"header:x-user-id\", \
                 set_headers = {{ authorization = \"Bearer k\" }} }}\n"
            ),
            "t",
        )
        .expect("valid");
        let m = &c.routes[0].mirrors[0];
        assert_eq!((m.upstream, m.percent, m.max_in_flight), (1, 20.0, 16));
        assert!(!m.cancel_with_client);
        assert_eq!(m.sticky.as_ref().map(|h| h.as_str()), Some("x-user-id"));
        assert_eq!(m.set_headers.len(), 1);
        let p = problems(&format!(
            "{two}[[route]]\nsplit = {{ a = 1 }}\n\
             mirror = [{{ upstream = \"a\" }}, {{ upstream = \"zz\", percent = 0, max_in_flight = 0, \
             sticky = \"cookie\", set_headers = {{ host = \"x\" }} }}, {{ percent = 5 }}]\n"
        ));
        for want in [
            "route[0].mirror[0].upstream: `a` is in the route's split",
            "route[0].mirror[1].upstream: unknown upstream `zz`",
            "route[0].mirror[1].percent: must be above 0",
            "route[0].mirror[1].max_in_flight: must be at least 1",
            "route[0].mirror[1].sticky: must be `header:NAME`",
            "route[0].mirror[1].set_headers.host: tokentap sets this one itself",
            "route[0].mirror[2].upstream: is required",
        ] {
            assert!(
                p.iter().any(|x| x.starts_with(want)),
                "missing {want:?} in {p:#?}"
            );
        }
        // A mirror must not be another route's primary.
        let p = problems(&format!(
            "{two}[[route]]\npath_prefix = \"/v1/\"\nsplit = {{ a = 1 }}\nmirror = {{ upstream = \"b\" }}\n\
             [[route]]\nsplit = {{ b = 1 }}\n"
        ));
        let want = "route[0].mirror[0].upstream: `b` is in route[1]'s split";
        assert!(
            p.iter().any(|x| x.starts_with(want)),
            "missing {want:?} in {p:#?}"
        );
    }

    /// A pool's keys: where its endpoints come from (one way), discovery, health, balance.
    #[test]
    fn a_pools_mistakes_are_each_reported() {
        let p = problems(concat!(
            "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nendpoints = [\"http://127.0.0.1:2\"]\n",
            "[[upstream]]\nname = \"b\"\nendpoints = [\"http://127.0.0.1:3\", \"http://127.0.0.1:3\", \"ftp://x:1\"]\n",
            "balance = \"random\"\neject_secs = 0\n",
            "[[upstream]]\nname = \"c\"\ndiscover = { dns = \"vllm.svc\", nameserver = \"dns\" }\n",
            "health = { path = \"health\", timeout_ms = 1, unhealthy_after = 0 }\n",
            "[[upstream]]\nname = \"d\"\ndiscover = { file = \"e.txt\", port = 80 }\nbackend_metrics_path = \"metrics\"\n",
            "[[upstream]]\nname = \"e\"\nendpoints = []\nbalance = \"slo_headroom\"\n",
            "[[route]]\nsplit = { a = 1 }\n",
        ));
        let want = [
            "upstream[0].url: give one of url, endpoints and discover",
            "upstream[1].endpoints[1]: 127.0.0.1:3 is listed twice",
            "upstream[1].endpoints[2]: scheme `ftp` is not http or https",
            "upstream[1].balance: must be \"least_loaded\", \"round_robin\", \"prefix\", \"slo_headroom\" or \"consistent_hash:header:NAME\", not `random`",
            "upstream[1].eject_secs: must be between 1 and 300",
            "upstream[2].discover.port: is required with dns",
            "upstream[2].discover.nameserver: must be an ip:port, not `dns`",
            "upstream[2].health.path: must be a path like /health, not `health`",
            "upstream[2].health.timeout_ms: must be between 10 and 60000",
            "upstream[2].health.unhealthy_after: must be at least 1",
            "upstream[3].discover.port: applies with dns only",
            "upstream[3].backend_metrics_path: must be a path like /metrics, not `metrics`",
            "upstream[4].endpoints: is empty",
            "upstream[4].balance: \"slo_headroom\" routes on the SLO: give slo.tpot_ms or slo.ttft_ms",
        ];
        for w in want {
            assert!(p.iter().any(|p| p.starts_with(w)), "missing {w}: {p:#?}");
        }
        assert_eq!(p.len(), want.len(), "{p:#?}");
        // A good pool: its endpoints in order, its settings.
        let c = Config::parse(
            "[[upstream]]\nname = \"p\"\nendpoints = [\"http://127.0.0.1:2\", \"https://localhost:8443\"]\nbalance = \"consistent_hash:header:x-session\"\nmax_concurrency_total = 12\n[upstream.health]\n",
            "t",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let u = &c.upstreams[0];
        let urls: Vec<&str> = u.endpoints.iter().map(|e| e.url.as_str()).collect();
        assert_eq!(urls, ["http://127.0.0.1:2", "https://localhost:8443"]);
        assert_eq!(u.endpoints[1].sni, "localhost");
        assert_eq!(
            u.balance,
            Balance::ConsistentHash(HeaderName::from_static("x-session"))
        );
        assert_eq!(u.max_concurrency_total, Some(12));
        let h = u.health.as_ref().unwrap_or_else(|| unreachable!());
        assert_eq!(
            (
                h.path.as_str(),
                h.every.as_secs(),
                h.unhealthy_after,
                h.healthy_after
            ),
            ("/health", 5, 2, 1)
        );
    }

    #[test]
    fn backend_metrics_is_an_http_url() {
        let got = problems(
            "[[upstream]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\nbackend_metrics = \"vllm:8000\"\nbackend_scrape_ms = 5\n\
             [[upstream]]\nname = \"b\"\nurl = \"http://127.0.0.1:2\"\nbackend_scrape_ms = 500\n\
             [[route]]\nsplit = { a = 1, b = 1 }\n",
        );
        assert_eq!(
            got,
            [
                "upstream[0].backend_metrics: must be an http:// URL like http://127.0.0.1:8000/metrics, not `vllm:8000` (line 4)",
                "upstream[0].backend_scrape_ms: must be between 100 and 60000 (line 5)",
                "upstream[1].backend_scrape_ms: applies with backend_metrics or backend_metrics_path only (line 9)",
            ]
        );
    }
}
