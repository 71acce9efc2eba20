//! The `/stats` document: every upstream's figures, its pool, its SLO and decisions, its
//! arms and its mirror, read from the meter and the state (docs/admin-api.md).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

use serde::Serialize;

use crate::meter::MeterStats;
use crate::service::Transport;
use crate::state::{Shared, Upstream};

/// The `/stats` document (docs/admin-api.md).
#[derive(Debug, Serialize)]
pub struct Stats {
    pub window_secs: u64,
    pub connections: ConnectionStats,
    pub upstreams: Vec<UpstreamReport>,
    /// Per tenant, with `[tenants]`; `null` without.
    pub tenants: Option<TenantsReport>,
    /// Each route's rollout (`GET /rollout` has their evaluations and history).
    pub rollouts: Vec<crate::rollout::RolloutSummary>,
}

/// `/stats` `tenants`: the tenants with the most output tokens, the rest as `other`.
#[derive(Debug, Clone, Serialize)]
pub struct TenantsReport {
    /// Tenants kept apart now (at most 1,024; the rest folded into `other`).
    pub tracked: usize,
    /// Requests whose priority header was not high, normal or low (served as their
    /// tenant's, else normal).
    pub invalid_priority_total: u64,
    /// Budget buckets kept now.
    pub budgets: usize,
    pub top: Vec<crate::tenant::book::TenantStats>,
}

/// Tenants shown by name in `/stats`.
const TENANTS_SHOWN: usize = 50;

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
    /// A route mirrors to it and none splits to it: its requests are copies (shadow
    /// traffic), metered, their answers discarded.
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
    /// When it does not, what misses: `tpot` for the tick's TPOT past `tpot_ms`, and with
    /// the attainment short of its target the SLOs the window's requests broke (`ttft`,
    /// `tpot`, `e2e`, `error`), most broken first. Empty when met.
    pub missed: Vec<&'static str>,
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
    /// read-ahead), `no_endpoint`, `cap` (no slot free under the upstream's own cap).
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
    /// Of those, idle past a second and parked with no task of their own.
    pub parked: usize,
    /// Idle keep-alive connections closed to make room for a new client at `max`.
    pub evicted_total: u64,
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
            parked: c.parked(),
            evicted_total: c.evicted(),
        },
        upstreams: shared
            .upstreams
            .iter()
            .enumerate()
            .map(|(i, u)| report(shared, i, u, now))
            .collect(),
        tenants: shared.tenants.config().any().then(|| TenantsReport {
            tracked: shared.book.len(),
            invalid_priority_total: (shared.book.invalid_priority)
                .load(std::sync::atomic::Ordering::Relaxed),
            budgets: shared.budgets.len(),
            top: shared.book.stats(
                std::time::Instant::now(),
                shared.config.window,
                TENANTS_SHOWN,
            ),
        }),
        rollouts: shared.rollouts.iter().map(|r| r.summary()).collect(),
    }
}

/// One upstream's part of `/stats`.
fn report(shared: &Shared, i: usize, u: &Upstream, now: crate::meter::Nanos) -> UpstreamReport {
    // The meter first, then the endpoints and the limiter: a request ends in the reverse
    // order (its endpoint's slot, then its meter, then its cap's slot; see `finish`), so a
    // document whose `in_flight` has fallen to 0 holds no slot of a request that ended
    // while the window was read (a read of milliseconds at a busy upstream).
    let meter = u.meter.stats(now);
    let endpoints = u.pool.stats(now, shared.config.window);
    let l = u.limiter.stats();
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
    let over = crate::decide::capacity::STEADY_WINDOWS
        .saturating_mul(u64::try_from(shared.config.window.as_nanos()).unwrap_or(u64::MAX));
    let capacity = u.steady.hold(now, capacity, over);
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
        rejected_total: l.rejected.iter().sum(),
        rejected_by_reason: (crate::limit::Rejected::ALL.iter())
            .zip(l.rejected)
            .map(|(why, n)| (why.label(), n))
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
                missed: missed(tick, attained, meter.goodput.map(|g| g.broken)),
                current_tpot_ms: current,
                slo_bounded_system_tps: bound.map(|b| b.system_tps),
                slo_bounded_concurrency: bound.map(|b| b.concurrency),
                // Under `slo_headroom` each endpoint's own controller moves its cap.
                controller: u.slo.as_ref().map(|a| match u.pool.caps_each_endpoint() {
                    true => "per_endpoint",
                    false => a.role().label(),
                }),
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
        mirror: only_mirror(shared, i),
        shadow: is_mirror(shared, i).then(|| {
            let s = &u.shadow;
            ShadowStats {
                in_flight: s.in_flight.load(Relaxed),
                skipped_total: [
                    ("max_in_flight", s.skipped_max_in_flight.load(Relaxed)),
                    ("body_unread", s.skipped_body_unread.load(Relaxed)),
                    ("no_endpoint", s.skipped_no_endpoint.load(Relaxed)),
                    ("cap", s.skipped_cap.load(Relaxed)),
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
            crate::config::Balance::Prefix => "prefix".into(),
            crate::config::Balance::SloHeadroom => "slo_headroom".into(),
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

/// Whether `upstream` takes copies only (a mirror that no route splits to; a rollout's
/// `to` serves its share and takes copies besides).
fn only_mirror(shared: &Shared, upstream: usize) -> bool {
    is_mirror(shared, upstream)
        && !(shared.config.routes.iter()).any(|r| r.split.iter().any(|&(u, _)| u == upstream))
}

/// The routes that send `upstream` traffic, and its weight in each (its share as a
/// rollout has it now, on a route with one).
fn arms(shared: &Shared, upstream: usize) -> Vec<Arm> {
    shared
        .config
        .routes
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            let effective = shared.router.rollout_split(i).map(|(_, s)| s);
            let split = effective.unwrap_or_else(|| r.split.clone());
            let total: u64 = split.iter().map(|&(_, w)| u64::from(w)).sum();
            let weight_of = |u: usize| {
                r.split
                    .iter()
                    .find(|&&(x, _)| x == u)
                    .map_or(0, |&(_, w)| w)
            };
            split
                .into_iter()
                .filter(move |&(u, _)| u == upstream)
                .map(move |(u, effective)| Arm {
                    route: r.name.clone(),
                    path_prefix: r.path_prefix.clone(),
                    weight: weight_of(u),
                    share_pct: if total > 0 {
                        100.0 * f64::from(effective) / total as f64
                    } else {
                        0.0
                    },
                })
        })
        .collect()
}

/// What misses of an upstream's SLOs (see [`SloStats::missed`]): the tick's TPOT when
/// past its SLO, and with the attainment short the SLOs the window's requests broke.
fn missed(
    tick: Option<bool>,
    attained: Option<bool>,
    broken: Option<crate::meter::Broken>,
) -> Vec<&'static str> {
    let mut out = Vec::new();
    if tick == Some(false) {
        out.push("tpot");
    }
    if let (Some(false), Some(b)) = (attained, broken) {
        let mut by = [
            ("ttft", b.ttft),
            ("tpot", b.tpot),
            ("e2e", b.e2e),
            ("error", b.error),
        ];
        by.sort_by_key(|&(_, n)| std::cmp::Reverse(n)); // stable: ties keep the judging order
        for (name, n) in by {
            if n > 0 && !out.contains(&name) {
                out.push(name);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SLO line names what misses: the tick's TPOT, or the SLOs the window's requests
    /// broke, most broken first; nothing when met.
    #[test]
    fn what_misses_is_named() {
        let broken = |ttft, tpot, e2e, error| {
            Some(crate::meter::Broken {
                ttft,
                tpot,
                e2e,
                error,
            })
        };
        // TPOT meets its SLO; TTFT (queued behind the cap) is what misses.
        assert_eq!(
            missed(Some(true), Some(false), broken(40, 0, 0, 0)),
            ["ttft"]
        );
        assert_eq!(
            missed(Some(false), Some(true), broken(0, 0, 0, 0)),
            ["tpot"]
        );
        assert_eq!(
            missed(Some(false), Some(false), broken(3, 9, 0, 1)),
            ["tpot", "ttft", "error"]
        );
        assert_eq!(
            missed(None, Some(false), broken(2, 2, 5, 0)),
            ["e2e", "ttft", "tpot"]
        );
        assert!(missed(Some(true), Some(true), broken(1, 0, 0, 0)).is_empty());
        assert!(missed(None, None, None).is_empty());
    }
}
