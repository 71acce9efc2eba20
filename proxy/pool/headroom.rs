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

use super::{lock, Endpoint, Pool};
use crate::limit::controller::{Controller, Slo, Tick};
use crate::meter::{EndpointMeter, Nanos};

/// The requests an endpoint's curve is fitted over: those that finished this recently…
pub(super) const FIT_WINDOW: Nanos = 20_000_000_000;
/// …at most this many, the latest.
const FIT_POINTS: usize = 512;
/// An endpoint without a curve is tried at most this often while others have room.
const EXPLORE_EVERY: Nanos = 1_000_000_000;

/// What `slo_headroom` routes on: the upstream's SLO.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Headroom {
    pub(super) tpot_ms: Option<f64>,
    pub(super) ttft_ms: Option<f64>,
    /// With `tpot_ms`: the SLO each endpoint's own cap holds.
    pub(super) cap: Option<Slo>,
}

/// One endpoint's steering under `slo_headroom`: its curve, its cap's controller.
#[derive(Default)]
pub(super) struct Steering {
    fit: Fit,
    controller: Option<Controller>,
    /// The last controller tick, and the last request sent to explore it.
    ticked: Nanos,
    explored: Option<Nanos>,
}

/// An endpoint's curve: TPOT and TTFT (from when a request was sent to it) as lines of the
/// batch; `None` without the requests to fit one.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fit {
    tpot: Option<Line>,
    ttft: Option<Line>,
    /// The requests it was fitted on.
    requests: u32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Line {
    a: f64,
    b: f64,
}

/// What `/stats` shows of an endpoint's curve under `slo_headroom`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct HeadroomStats {
    /// Its curve's TPOT and TTFT with one more request, ms (`null`: no curve).
    pub next_tpot_ms: Option<f64>,
    pub next_ttft_ms: Option<f64>,
    /// The requests its curve was fitted on (those of the last 20 s).
    pub curve_requests: u32,
}

/// Where an endpoint stands for one more request, best first when sorted down.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
struct Rank {
    /// 4: meets both SLOs; 3: no curve; 2: meets the TPOT SLO only; 1: the TTFT one only;
    /// 0: neither.
    class: u8,
    /// Its room under the SLO, as a share of it (the TPOT one's, else the TTFT one's); for
    /// an endpoint without a curve, minus its requests in flight.
    room: f64,
    then: f64,
}

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

/// The batch one more request would make on an endpoint with `in_flight` of tokentap's.
fn next_batch(meter: &EndpointMeter, in_flight: u64) -> f64 {
    meter.batch_now(in_flight) as f64 + 1.0
}

/// An endpoint's curve over its requests of the last [`FIT_WINDOW`], and its controller's
/// evidence: the `percentile` of the TPOT of those that finished since `since` and the mean
/// batch they ran in.
fn evidence(meter: &EndpointMeter, now: Nanos, since: Nanos, percentile: f64) -> (Fit, Tick) {
    let (mut tpot, mut ttft) = (Vec::new(), Vec::new());
    let (mut tick, mut batches) = (Vec::new(), 0.0);
    let mut requests = 0u32;
    meter.finished_since(now.saturating_sub(FIT_WINDOW), |d| {
        let x = d.batch.max(1) as f64;
        if let Some(t) = d.tpot_ms {
            tpot.push((x, t));
            if d.at > since {
                tick.push(t);
                batches += x;
            }
        }
        if let Some(t) = d.sent_ttft_ms {
            ttft.push((x, t));
        }
        requests += 1;
        (requests as usize) < FIT_POINTS
    });
    let fit = Fit {
        tpot: Line::fit(&tpot),
        ttft: Line::fit(&ttft),
        requests,
    };
    let concurrency = if tick.is_empty() {
        0.0
    } else {
        batches / tick.len() as f64
    };
    let tpot_ms = (!tick.is_empty()).then(|| {
        tick.sort_unstable_by(f64::total_cmp);
        let rank = (percentile / 100.0 * tick.len() as f64).ceil() as usize;
        tick[rank.clamp(1, tick.len()) - 1]
    });
    let tick = Tick {
        tpot_ms,
        concurrency,
        in_flight: 0,
        queued: false,
    };
    (fit, tick)
}

// === impl Fit ===

impl Fit {
    /// Where the endpoint stands for a request that makes its batch `x`; `None` without a
    /// curve for what the SLO asks.
    fn rank(&self, h: &Headroom, x: f64) -> Option<Rank> {
        if self.requests == 0 {
            return None;
        }
        // Room under each SLO given, as a share of it; `None`: that SLO is not given.
        let share = |slo: Option<f64>, line: Option<Line>| -> Option<Option<f64>> {
            match slo {
                None => Some(None),
                Some(slo) => line.map(|l| Some((slo - l.at(x)) / slo)),
            }
        };
        let tpot = share(h.tpot_ms, self.tpot)?;
        let ttft = share(h.ttft_ms, self.ttft)?;
        let meets = |r: Option<f64>| r.is_none_or(|r| r >= 0.0);
        let class = match (meets(tpot), meets(ttft)) {
            (true, true) => 4,
            (true, false) => 2,
            (false, true) => 1,
            (false, false) => 0,
        };
        let (room, then) = match (tpot, ttft) {
            (Some(p), t) => (p, t.unwrap_or(0.0)),
            (None, t) => (t.unwrap_or(0.0), 0.0),
        };
        Some(Rank { class, room, then })
    }
}

// === impl Line ===

impl Line {
    fn at(&self, x: f64) -> f64 {
        self.a + self.b * x
    }

    /// The least-squares line of `points` (x, y), its slope at least 0 (a larger batch never
    /// serves faster); flat at their mean when the x do not spread. `None`: no points.
    fn fit(points: &[(f64, f64)]) -> Option<Line> {
        if points.is_empty() {
            return None;
        }
        let n = points.len() as f64;
        let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
        let my = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let b = if sxx >= 1.0 {
            (sxy / sxx).max(0.0)
        } else {
            0.0
        };
        Some(Line { a: my - b * mx, b })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: Headroom = Headroom {
        tpot_ms: Some(30.0),
        ttft_ms: Some(200.0),
        cap: None,
    };

    #[test]
    fn a_line_never_falls_and_is_flat_without_spread() {
        let l = Line::fit(&[(1.0, 20.0), (8.0, 27.0), (16.0, 35.0)]).unwrap();
        assert!((l.at(16.0) - 34.9).abs() < 0.5, "{l:?}");
        let flat = Line::fit(&[(4.0, 20.0), (4.0, 22.0)]).unwrap();
        assert_eq!((flat.a, flat.b), (21.0, 0.0));
        let falling = Line::fit(&[(1.0, 30.0), (8.0, 20.0)]).unwrap();
        assert_eq!(falling.b, 0.0);
        assert_eq!(Line::fit(&[]), None);
    }

    #[test]
    fn an_endpoint_that_meets_the_slo_ranks_above_one_without_a_curve_and_one_that_misses() {
        let fit = |a: f64, b: f64| Fit {
            tpot: Some(Line { a, b }),
            ttft: Some(Line { a: 50.0, b: 0.0 }),
            requests: 10,
        };
        let fast = fit(20.0, 0.5).rank(&H, 8.0).unwrap();
        let busy = fit(20.0, 0.5).rank(&H, 16.0).unwrap();
        let slow = fit(40.0, 1.0).rank(&H, 1.0).unwrap();
        // The slow one meets the TTFT SLO only.
        assert_eq!((fast.class, busy.class, slow.class), (4, 4, 1));
        assert!(fast > busy && busy.room > 0.0 && slow.room < 0.0);
        let unknown = Rank {
            class: 3,
            room: 0.0,
            then: 0.0,
        };
        assert!(busy > unknown && unknown > slow);
        // No curve for the SLO asked (no request with two tokens): unranked.
        let no_tpot = Fit {
            tpot: None,
            ..fit(20.0, 0.0)
        };
        assert_eq!(no_tpot.rank(&H, 1.0), None);
        assert_eq!(Fit::default().rank(&H, 1.0), None);
    }
}
