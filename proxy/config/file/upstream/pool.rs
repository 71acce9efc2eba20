//! An upstream's endpoints (`url`, `endpoints`, `discover`) and their active health checks.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use super::UpstreamFile;
use crate::config::{Discover, EndpointAddr, HealthCheck, Problems};

/// The default of `discover.every_secs`: how often the endpoints are found again.
pub(crate) const DISCOVER_EVERY_SECS: u64 = 5;

/// The default of `health.every_secs`: how often each endpoint is checked.
pub(crate) const HEALTH_EVERY_SECS: u64 = 5;

/// The default of `health.timeout_ms`: a check's time to answer.
pub(crate) const HEALTH_TIMEOUT_MS: u64 = 1000;

/// The default of `health.unhealthy_after`: failed checks in a row that take an endpoint out.
pub(crate) const UNHEALTHY_AFTER: u32 = 2;

/// The default of `health.healthy_after`: good checks in a row that bring it back.
pub(crate) const HEALTHY_AFTER: u32 = 1;

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

/// The endpoints `url` or `endpoints` give (exactly one of them, or `discover`), resolved,
/// none of them tokentap's own addresses; and `url` as written.
pub(super) fn endpoints(
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

pub(super) fn discover(i: usize, d: &DiscoverFile, p: &mut Problems) -> Option<Discover> {
    let at = |f: &str| format!("upstream[{i}].discover.{f}");
    let every = d.every_secs.unwrap_or(DISCOVER_EVERY_SECS);
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

pub(super) fn health(i: usize, h: &HealthFile, p: &mut Problems) -> Option<HealthCheck> {
    let at = |f: &str| format!("upstream[{i}].health.{f}");
    let path = h.path.clone().unwrap_or_else(|| "/health".into());
    if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
        p.add(
            at("path"),
            format!("must be a path like /health, not `{path}`"),
        );
    }
    let every = h.every_secs.unwrap_or(HEALTH_EVERY_SECS);
    if !(1..=3600).contains(&every) {
        p.add(at("every_secs"), "must be between 1 and 3600");
    }
    let timeout = h.timeout_ms.unwrap_or(HEALTH_TIMEOUT_MS);
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
        unhealthy_after: h.unhealthy_after.unwrap_or(UNHEALTHY_AFTER).max(1),
        healthy_after: h.healthy_after.unwrap_or(HEALTHY_AFTER).max(1),
    })
}
