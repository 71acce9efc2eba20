//! `[listen]`, `[server]`, `[admin]` and `[log]`: where tokentap listens, its limits on
//! clients, who may use the admin API, and its logs.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::config::{
    socket_addr, tls, AccessLog, AdminAuth, Limits, ListenTls, Log, LogFormat, Problems, Secret,
    ADMIN_TOKEN_ENV, DEFAULT_LOG_FILTER,
};

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
    pub(super) fn log(&self, p: &mut Problems) -> Log {
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

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminFile {
    /// A file holding the admin token: when set (or `TOKENTAP_ADMIN_TOKEN` is), every admin
    /// endpoint but `/healthz` needs `Authorization: Bearer TOKEN`. Default: none.
    pub token_file: Option<String>,
    /// `/metrics` answers without the token. Default false.
    pub metrics_public: bool,
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
    pub(super) fn tls(&self, p: &mut Problems) -> Option<ListenTls> {
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
    pub(super) fn auth(&self, p: &mut Problems) -> AdminAuth {
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
    pub(super) fn limits(&self, p: &mut Problems) -> Limits {
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

impl ListenFile {
    /// The proxy's and the admin's addresses, each its own.
    pub(super) fn addrs(
        &self,
        p: &mut Problems,
    ) -> (Result<SocketAddr, ()>, Result<SocketAddr, ()>) {
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
