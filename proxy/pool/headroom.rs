//! `balance = "slo_headroom"`: each endpoint's own curve — its requests' TPOT and TTFT
//! against the batch they ran in, fitted each second over the last [`FIT_WINDOW`] — predicts
//! how it would serve one more request, and a request goes where that prediction leaves the
//! most room under the upstream's SLO. With `slo.tpot_ms`, each endpoint also holds a cap of
//! its own, moved by its own controller ([`crate::limit::controller`]) on its own requests'
//! TPOT: replicas that differ (an H100 beside an A100, two engines) share one upstream
//! without one pooled limit that assumes they are alike.
//!
//! The order, for each request:
//! 1. endpoints that meet the SLO with one more request (TPOT, then TTFT), the most room
//!    under `tpot_ms` first (under `ttft_ms` without one);
//! 2. endpoints without a curve (no request finished there within [`FIT_WINDOW`]: new, or
//!    spared that long), the least loaded first;
//! 3. endpoints predicted to miss it, the least over first;
//!
//! each only where it has room under its cap. An endpoint without a curve is also tried on
//! its own, one request at a time and at most one each [`EXPLORE_EVERY`], while others meet
//! the SLO: that is how a replica that recovered, or one just added, is learned. A replica
//! that cannot meet the SLO even alone gets no request while another has room, but for that
//! bounded exploration (about one each `FIT_WINDOW`).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use super::curve::{evidence, next_batch, Headroom, HeadroomStats, Line, Rank, Steering};
use super::{lock, Endpoint, Pool};
use crate::limit::controller::{Controller, Tick};
use crate::meter::Nanos;

/// An endpoint without a curve is tried at most this often while others have room.
const EXPLORE_EVERY: Nanos = 1_000_000_000;

// === impl Pool ===

impl Pool {
    /// The endpoint `slo_headroom` picks among those `takes` allows, where `room` takes its
    /// slot; `None`: none has room.
    pub(super) fn by_headroom<'a>(
        &self,
        h: &Headroom,
        members: &'a [Arc<Endpoint>],
        now: Nanos,
        takes: &dyn Fn(&Endpoint) -> bool,
        room: &dyn Fn(&Endpoint) -> bool,
    ) -> Option<&'a Arc<Endpoint>> {
        let mut ranked: Vec<(Rank, &'a Arc<Endpoint>)> = Vec::with_capacity(members.len());
        let mut unexplored = None;
        for e in members.iter().filter(|e| takes(e)) {
            let in_flight = e.in_flight();
            let st = lock(&e.steering);
            let rank = match st.fit.rank(h, next_batch(&e.meter, in_flight)) {
                Some(rank) => rank,
                None => {
                    let due = st.explored.is_none_or(|t| now >= t + EXPLORE_EVERY);
                    if in_flight == 0 && due && unexplored.is_none() {
                        unexplored = Some(e);
                    }
                    Rank {
                        class: 3,
                        room: -(in_flight as f64),
                        then: 0.0,
                    }
                }
            };
            ranked.push((rank, e));
        }
        // While another meets the SLO, an endpoint without a curve gets one request to learn
        // it by, at most one each EXPLORE_EVERY.
        if let Some(e) = unexplored {
            if ranked.iter().any(|(r, _)| r.class == 4) && room(e) {
                lock(&e.steering).explored = Some(now);
                return Some(e);
            }
        }
        ranked.sort_unstable_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal));
        ranked.into_iter().map(|(_, e)| e).find(|e| room(e))
    }

    /// Whether its endpoints hold caps of their own (`slo_headroom` with a TPOT SLO): the
    /// upstream's one adaptive cap then steers nothing.
    pub fn caps_each_endpoint(&self) -> bool {
        self.settings
            .load()
            .headroom
            .is_some_and(|h| h.cap.is_some())
    }

    /// Once a second under `slo_headroom`: each endpoint's curve fitted again, and with a
    /// TPOT SLO its cap moved by its own controller and the pool's limit made the sum of
    /// the caps of those that take requests. Under any other balance, the pool's one limit
    /// again.
    pub(super) fn steer(&self, now: Nanos) {
        let members = self.members.load();
        let Some(h) = self.settings.load().headroom else {
            if members
                .iter()
                .any(|e| e.cap.load(Relaxed) != super::endpoint::POOLED)
            {
                for e in members.iter() {
                    e.cap.store(super::endpoint::POOLED, Relaxed);
                    *lock(&e.steering) = Steering::default();
                }
            }
            self.limiter.set_sum(None);
            return;
        };
        let queued = self.limiter.take_binding();
        let (mut eligible, mut healthy) = (0u64, 0u64);
        for e in members.iter() {
            let mut st = lock(&e.steering);
            let percentile = h.cap.map_or(90.0, |slo| slo.percentile);
            let (fit, tick) = evidence(&e.meter, now, st.ticked, percentile);
            st.ticked = now;
            st.fit = fit;
            let Some(slo) = h.cap else { continue };
            let ctl = st.controller.get_or_insert_with(|| Controller::new(slo));
            ctl.retune(slo);
            let cap = ctl.update(Tick {
                in_flight: e.in_flight(),
                queued,
                ..tick
            });
            e.cap.store(cap, Relaxed);
            if e.eligible(now) {
                eligible += cap;
            }
            if e.healthy.load(Relaxed) {
                healthy += cap;
            }
        }
        // Panic mode (none eligible) counts those that pass their checks, as the limiter's
        // members do.
        let sum = if eligible > 0 { eligible } else { healthy };
        self.limiter.set_sum(h.cap.is_some().then_some(sum.max(1)));
    }
}

// === impl Endpoint ===

impl Endpoint {
    /// Its curve's figures under `slo_headroom` (`None` under another balance).
    pub(super) fn headroom(&self, steering: bool) -> Option<HeadroomStats> {
        if !steering {
            return None;
        }
        let st = lock(&self.steering);
        let x = next_batch(&self.meter, self.in_flight());
        let at = |l: Option<Line>| l.map(|l| (l.at(x) * 100.0).round() / 100.0);
        Some(HeadroomStats {
            next_tpot_ms: at(st.fit.tpot),
            next_ttft_ms: at(st.fit.ttft),
            curve_requests: st.fit.requests,
        })
    }
}

#[cfg(test)]
impl Endpoint {
    /// Its curve: TPOT `a + b·batch`, TTFT 10 ms (`None`: no curve).
    pub(super) fn set_curve(&self, tpot: Option<(f64, f64)>) {
        use super::curve::Fit;
        lock(&self.steering).fit = match tpot {
            Some((a, b)) => Fit {
                tpot: Some(Line { a, b }),
                ttft: Some(Line { a: 10.0, b: 0.0 }),
                requests: 10,
            },
            None => Fit::default(),
        };
    }
}
