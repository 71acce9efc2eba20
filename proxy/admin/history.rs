//! What the dashboard and `tokentap top` watch: one snapshot a second, pushed to every
//! `GET /events` subscriber, and a ring of the last 15 minutes of them at 1 s resolution
//! (`GET /stats/history`), so a page opened now shows the recent past.
//!
//! One sampler makes each snapshot once and serialises it once; subscribers get the same
//! `Arc<str>` through a watch channel, so many open pages cost what one does. The A/B
//! comparison (a bootstrap over every sample in its window) runs only while someone
//! watches, and at most every [`COMPARE_EVERY`].

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::sync::watch;

use super::{compare, stats, Stats};
use crate::compare::Comparison;
use crate::meter::Percentiles;
use crate::service::Transport;
use crate::state::Live;

/// Snapshots kept: 15 minutes at one a second.
pub const HISTORY_POINTS: usize = 900;
/// How often the A/B comparison is run again for the subscribers.
pub const COMPARE_EVERY: Duration = Duration::from_secs(5);
/// Open `/events` streams at most; more are refused with 503.
pub const MAX_SUBSCRIBERS: usize = 32;

/// One upstream at one second: what the time-series charts draw.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct UpstreamPoint {
    pub name: String,
    pub in_flight: u64,
    pub queued: u64,
    pub limit: Option<u64>,
    pub concurrency: Option<f64>,
    pub system_tps: Option<f64>,
    pub single_stream_tps: Option<f64>,
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub estimated_tokens_share_pct: Option<f64>,
    pub slo_tpot_ms: Option<f64>,
    pub slo_current_tpot_ms: Option<f64>,
    pub requests_total: u64,
    pub errors_total: u64,
    pub output_tokens_total: u64,
    /// What the figures decide (each `null` without its config): goodput req/s and
    /// attainment, cost per million output tokens now and at the SLO bound, MBU, the
    /// endpoints needed.
    pub goodput_rps: Option<f64>,
    pub attainment_pct: Option<f64>,
    pub cost_per_million: Option<f64>,
    pub cost_per_million_at_slo: Option<f64>,
    pub mbu_pct: Option<f64>,
    pub endpoints_needed: Option<u64>,
}

/// Every upstream at one second.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Point {
    /// Unix time, milliseconds.
    pub t: u64,
    pub upstreams: Vec<UpstreamPoint>,
}

impl Point {
    fn of(t: u64, stats: &Stats) -> Point {
        Point {
            t,
            upstreams: stats
                .upstreams
                .iter()
                .map(|r| {
                    let m = &r.meter;
                    UpstreamPoint {
                        name: m.name.clone(),
                        in_flight: m.in_flight,
                        queued: r.queued,
                        limit: r.limit,
                        concurrency: m.concurrency,
                        system_tps: m.system_tps,
                        single_stream_tps: m.single_stream_tps,
                        ttft_ms: m.ttft_ms,
                        tpot_ms: m.tpot_ms,
                        itl_ms: m.itl_ms,
                        estimated_tokens_share_pct: m.estimated_tokens_share_pct,
                        slo_tpot_ms: r.slo.as_ref().and_then(|s| s.tpot_ms),
                        slo_current_tpot_ms: r.slo.as_ref().and_then(|s| s.current_tpot_ms),
                        requests_total: m.requests_total,
                        errors_total: m.errors_total,
                        output_tokens_total: m.output_tokens_total,
                        goodput_rps: m.goodput.and_then(|g| g.requests_per_sec),
                        attainment_pct: m.goodput.and_then(|g| g.attainment_pct),
                        cost_per_million: r.cost.as_ref().and_then(|c| c.per_million_output_tokens),
                        cost_per_million_at_slo: r
                            .cost
                            .as_ref()
                            .and_then(|c| c.per_million_at_slo_bounded),
                        mbu_pct: r.roofline.as_ref().and_then(|x| x.mbu_pct),
                        endpoints_needed: r.capacity.endpoints_needed,
                    }
                })
                .collect(),
        }
    }
}

/// One `/events` message.
#[derive(Serialize)]
struct Snapshot<'a> {
    t: u64,
    version: &'static str,
    /// This second's point, as `/stats/history` keeps it.
    point: &'a Point,
    /// The whole `/stats` document of this second.
    stats: &'a Stats,
    /// The default pair's comparison (the first split's arms), at most
    /// [`COMPARE_EVERY`] old; `null` when no route splits traffic.
    compare: Option<&'a Comparison>,
    /// The first route mirror's paired comparison (shadow traffic), as often; `null`
    /// without a mirror.
    shadow: Option<&'a crate::compare::paired::PairedComparison>,
}

/// The ring and the subscribers' channel.
pub struct History {
    ring: Mutex<VecDeque<Arc<Point>>>,
    latest: watch::Sender<Arc<str>>,
    subscribers: AtomicUsize,
}

/// An open `/events` stream; dropping it frees its place.
pub struct Subscription<'a> {
    history: &'a History,
    pub updates: watch::Receiver<Arc<str>>,
}

impl Drop for Subscription<'_> {
    fn drop(&mut self) {
        self.history.subscribers.fetch_sub(1, Relaxed);
    }
}

// === impl History ===

impl History {
    pub fn new() -> Self {
        History {
            ring: Mutex::new(VecDeque::with_capacity(HISTORY_POINTS)),
            latest: watch::Sender::new(Arc::from("")),
            subscribers: AtomicUsize::new(0),
        }
    }

    /// A place among the subscribers, or `None` when [`MAX_SUBSCRIBERS`] are open.
    pub fn subscribe(&self) -> Option<Subscription<'_>> {
        let n = self.subscribers.fetch_add(1, Relaxed);
        let sub = Subscription {
            history: self,
            updates: self.latest.subscribe(),
        };
        (n < MAX_SUBSCRIBERS).then_some(sub)
    }

    /// The `/stats/history` document: `{"interval_secs": 1, "points": [...]}`, oldest first.
    pub fn document(&self) -> serde_json::Result<Vec<u8>> {
        let ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        let points: Vec<&Point> = ring.iter().map(|p| &**p).collect();
        serde_json::to_vec(&serde_json::json!({
            "interval_secs": 1,
            "points": points,
        }))
    }

    fn push(&self, point: Arc<Point>) {
        let mut ring = self.ring.lock().unwrap_or_else(PoisonError::into_inner);
        if ring.len() == HISTORY_POINTS {
            ring.pop_front();
        }
        ring.push_back(point);
    }

    /// Samples `live` once a second until `shutdown` changes.
    pub async fn run(
        &self,
        live: &Live,
        transport: &Transport,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut compared: Option<(tokio::time::Instant, Comparison)> = None;
        let mut shadowed: Option<crate::compare::paired::PairedComparison> = None;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            let shared = live.load();
            let stats = stats(&shared, transport);
            let point = Arc::new(Point::of(unix_ms(), &stats));
            self.push(Arc::clone(&point));
            // Serialised every second, so a new subscriber's first message is at most 1 s
            // old; compared only while someone watches.
            let watched = self.latest.receiver_count() > 0;
            let stale = compared
                .as_ref()
                .is_none_or(|(at, _)| at.elapsed() >= COMPARE_EVERY);
            if !watched {
                compared = None;
                shadowed = None;
            } else if stale {
                compared = compare(&shared, None)
                    .ok()
                    .map(|c| (tokio::time::Instant::now(), c));
                shadowed = super::default_paired(&shared);
            }
            let snapshot = Snapshot {
                t: point.t,
                version: env!("CARGO_PKG_VERSION"),
                point: &point,
                stats: &stats,
                compare: compared.as_ref().map(|(_, c)| c),
                shadow: shadowed.as_ref(),
            };
            if let Ok(text) = serde_json::to_string(&snapshot) {
                self.latest.send_replace(Arc::from(text));
            }
        }
    }
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_last_fifteen_minutes() {
        let h = History::new();
        for t in 0..(HISTORY_POINTS as u64 + 5) {
            h.push(Arc::new(Point {
                t,
                upstreams: Vec::new(),
            }));
        }
        let doc: serde_json::Value =
            serde_json::from_slice(&h.document().unwrap_or_default()).unwrap_or_default();
        let points = doc["points"].as_array().cloned().unwrap_or_default();
        assert_eq!(points.len(), HISTORY_POINTS);
        assert_eq!(points[0]["t"], 5);
    }

    #[test]
    fn subscribers_are_bounded_and_freed() {
        let h = History::new();
        let subs: Vec<_> = (0..MAX_SUBSCRIBERS).filter_map(|_| h.subscribe()).collect();
        assert_eq!(subs.len(), MAX_SUBSCRIBERS);
        assert!(h.subscribe().is_none());
        drop(subs);
        assert!(h.subscribe().is_some());
    }
}
