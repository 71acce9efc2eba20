//! tokentap's log: `tracing` events as text or JSON lines on stderr, through a
//! `RUST_LOG`-style filter that a reload can change; pingora's own `log` records are bridged
//! in. A failure that can repeat at the rate of requests is logged through [`Throttle`]: at
//! most one line a second per upstream and cause, the next saying how many were held back.
//!
//! Nothing logged carries a prompt, a completion, a header value or a query string: request
//! lines name the method, the path without its query, the upstream and the cause.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter, Registry};

use crate::config::{Log, LogFormat};

/// The environment variable whose filter overrides `log.filter`.
pub const FILTER_ENV: &str = "RUST_LOG";

static FILTER: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();

/// Installs the process's log (once; later calls change nothing): `format` on stderr,
/// filtered by `RUST_LOG` if set, else by `log.filter`.
pub fn init(format: LogFormat, log: &Log) {
    let (filter, handle) = reload::Layer::new(filter_of(log));
    let registry = tracing_subscriber::registry().with(filter);
    let installed = match format {
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                    .with_target(false),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(false)
                    .with_span_list(false)
                    .with_writer(std::io::stderr),
            )
            .try_init(),
    };
    if installed.is_ok() {
        let _ = FILTER.set(handle);
    }
}

/// Applies `log.filter` from a reloaded config; returns a note when `RUST_LOG` overrides it.
pub fn apply(log: &Log) -> Vec<String> {
    let Some(handle) = FILTER.get() else {
        return Vec::new();
    };
    if std::env::var_os(FILTER_ENV).is_some() {
        return vec![format!(
            "log.filter: {FILTER_ENV} is set and wins over the file's filter"
        )];
    }
    match handle.reload(filter_of(log)) {
        Ok(()) => Vec::new(),
        Err(e) => vec![format!("log.filter: not applied: {e}")],
    }
}

fn filter_of(log: &Log) -> EnvFilter {
    let from_env = std::env::var(FILTER_ENV)
        .ok()
        .and_then(|f| EnvFilter::builder().parse(f).ok());
    // `log.filter` was parsed when the config was checked.
    from_env.unwrap_or_else(|| {
        EnvFilter::builder()
            .parse(&log.filter)
            .unwrap_or_else(|_| EnvFilter::new("info"))
    })
}

type ThrottleKey = (String, &'static str);

/// At most one line a second per key; the lines held back are counted into the next.
#[derive(Default)]
pub struct Throttle {
    /// (upstream, cause) → (the second of its last line since `start`, lines held back).
    last: Mutex<HashMap<ThrottleKey, (u64, u64)>>,
    start: OnceLock<Instant>,
}

impl Throttle {
    /// Whether a line for `key` may be written now, and how many were held back before it.
    pub fn admit(&self, upstream: &str, cause: &'static str) -> Option<u64> {
        let now = self.start.get_or_init(Instant::now).elapsed().as_secs();
        self.admit_at(upstream, cause, now)
    }

    /// As [`Throttle::admit`], `now` being the second.
    fn admit_at(&self, upstream: &str, cause: &'static str, now: u64) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        match last.get_mut(&(upstream.to_owned(), cause)) {
            Some((second, held)) if *second == now => {
                *held += 1;
                None
            }
            Some((second, held)) => {
                *second = now;
                Some(std::mem::take(held))
            }
            None => {
                last.insert((upstream.to_owned(), cause), (now, 0));
                Some(0)
            }
        }
    }
}

/// The lines at start: each listener, each upstream, what is off by choice.
pub fn started(config: &crate::config::Config) {
    let scheme = if config.listen.tls.is_some() {
        "https"
    } else {
        "http"
    };
    tracing::info!(
        threads = config.threads,
        "proxy listening on {scheme}://{}",
        config.listen.proxy
    );
    tracing::info!(
        auth = if config.admin.token.is_some() {
            "token"
        } else {
            "none"
        },
        "admin listening on http://{} (/stats, /metrics, /compare, /reload, /healthz)",
        config.listen.admin
    );
    for u in &config.upstreams {
        let cap = u
            .slo
            .map(|s| format!("adaptive, SLO TPOT p{} ≤ {} ms", s.percentile, s.tpot_ms))
            .or(u.max_concurrency.map(|c| format!("{c}")))
            .unwrap_or_else(|| "none".into());
        let addrs: Vec<String> = u.endpoints.iter().map(|e| e.addr.to_string()).collect();
        tracing::info!(
            upstream = %u.name,
            cap = %cap,
            "upstream {} at {} ({})",
            u.name,
            u.source(),
            if addrs.is_empty() { "found while running".to_owned() } else { addrs.join(" ") }
        );
        if u.endpoints.iter().any(|e| e.tls) && !u.tls_verify {
            tracing::warn!(
                upstream = %u.name,
                "upstream {}: tls_verify = false: its certificate is not checked",
                u.name
            );
        }
    }
    match &config.log.access {
        crate::config::AccessLog::Off => {}
        crate::config::AccessLog::Stdout => tracing::info!("access log on stdout"),
        crate::config::AccessLog::Stderr => tracing::info!("access log on stderr"),
        crate::config::AccessLog::File(p) => tracing::info!("access log in {}", p.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_lets_one_line_a_second_through_per_key() {
        let t = Throttle::default();
        assert_eq!(t.admit_at("a", "connect_refused", 7), Some(0));
        assert_eq!(t.admit_at("a", "connect_refused", 7), None);
        assert_eq!(t.admit_at("a", "connect_refused", 7), None);
        assert_eq!(
            t.admit_at("a", "upstream_timeout", 7),
            Some(0),
            "another cause"
        );
        assert_eq!(
            t.admit_at("b", "connect_refused", 7),
            Some(0),
            "another upstream"
        );
        assert_eq!(
            t.admit_at("a", "connect_refused", 8),
            Some(2),
            "held back, counted"
        );
        assert_eq!(t.admit_at("a", "connect_refused", 9), Some(0));
    }
}
