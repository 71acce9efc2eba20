//! `[[route]]` and its `mirror`: which requests go where, and what is copied to whom.

use http::header::HeaderName;
use indexmap::IndexMap;
use serde::Deserialize;

use crate::config::{Mirror, Problems, Route};

/// The default of `mirror.percent`: the share of a route's generation requests copied.
pub(crate) const MIRROR_PERCENT: f64 = 100.0;

/// The default of `mirror.max_in_flight`: copies in flight at once, at most.
pub(crate) const MIRROR_MAX_IN_FLIGHT: u64 = 16;

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
    /// A progressive rollout between two upstreams of the split, stepped on the measured
    /// comparison: `{ from = "a", to = "b" }` and its bounds. Default: none.
    #[serde(default)]
    pub rollout: Option<super::RolloutFile>,
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

/// `route[i]` checked (its split against the upstreams' names, its name against the
/// `earlier` routes') and made the runtime's; its problems added.
pub(super) fn route(
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
    let rollout = (r.rollout.as_ref())
        .and_then(|ro| super::rollout::rollout(&at("rollout"), ro, &split, &index, p));
    // A rollout's `to` may be mirrored to on its own route: that mirror is its shadow.
    let shadow = rollout.as_ref().map(|ro| ro.to);
    let mut mirrors: Vec<Mirror> = (r.mirror.iter().enumerate())
        .filter_map(|(j, m)| {
            let at = at(&format!("mirror[{j}]"));
            mirror(&at, m, &split, &index, shadow, p)
        })
        .collect();
    if let Some(to) = shadow.filter(|&to| !mirrors.iter().any(|m| m.upstream == to)) {
        mirrors.push(rollout_shadow(to));
    }
    Route {
        name,
        path_prefix: r.path_prefix.clone(),
        headers,
        split,
        sticky,
        spill: r.spill,
        mirrors,
        rollout,
    }
}

/// The shadow a rollout sends `to` when its route configures none: copies marked
/// `x-tokentap-shadow: rollout`, run to their end, at most 256 in flight; their share set
/// by the rollout as it goes.
fn rollout_shadow(to: usize) -> Mirror {
    Mirror {
        upstream: to,
        percent: MIRROR_PERCENT,
        max_in_flight: 256,
        set_headers: vec![(
            HeaderName::from_static("x-tokentap-shadow"),
            "rollout".to_owned(),
        )],
        cancel_with_client: false,
        sticky: None,
    }
}

/// One `route[i].mirror[j]` (`at`) checked: its upstream known and not one the route
/// splits to (a primary would be sent twice), its share and cap in range, its headers
/// valid.
pub(super) fn mirror(
    at: &str,
    m: &MirrorFile,
    split: &[(usize, u32)],
    index: &impl Fn(&str) -> Option<usize>,
    rollout_to: Option<usize>,
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
        Some(u) if split.iter().any(|&(s, _)| s == u) && rollout_to != Some(u) => {
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
    let percent = m.percent.unwrap_or(MIRROR_PERCENT);
    if !(percent > 0.0 && percent <= 100.0) {
        p.add(
            key("percent"),
            format!("must be above 0 and at most 100, not {percent}"),
        );
    }
    let max_in_flight = m.max_in_flight.unwrap_or(MIRROR_MAX_IN_FLIGHT);
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
