//! An endpoint's own curve under `balance = "slo_headroom"` ([`super::headroom`]): its
//! requests' TPOT and TTFT (from when each was sent to it) as least-squares lines of the
//! batch they ran in, fitted each second over the last [`FIT_WINDOW`]; where it stands for
//! one more request against the upstream's SLO ([`Rank`]); its controller's evidence.

use crate::limit::controller::{Controller, Slo, Tick};
use crate::meter::{EndpointMeter, Nanos};

/// The requests an endpoint's curve is fitted over: those that finished this recently…
pub(super) const FIT_WINDOW: Nanos = 20_000_000_000;
/// …at most this many, the latest.
const FIT_POINTS: usize = 512;

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
    pub(super) fit: Fit,
    pub(super) controller: Option<Controller>,
    /// The last controller tick, and the last request sent to explore it.
    pub(super) ticked: Nanos,
    pub(super) explored: Option<Nanos>,
}

/// An endpoint's curve: TPOT and TTFT (from when a request was sent to it) as lines of the
/// batch; `None` without the requests to fit one.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fit {
    pub(super) tpot: Option<Line>,
    pub(super) ttft: Option<Line>,
    /// The requests it was fitted on.
    pub(super) requests: u32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Line {
    pub(super) a: f64,
    pub(super) b: f64,
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
pub(super) struct Rank {
    /// 4: meets both SLOs; 3: no curve; 2: meets the TPOT SLO only; 1: the TTFT one only;
    /// 0: neither.
    pub(super) class: u8,
    /// Its room under the SLO, as a share of it (the TPOT one's, else the TTFT one's); for
    /// an endpoint without a curve, minus its requests in flight.
    pub(super) room: f64,
    pub(super) then: f64,
}

/// The batch one more request would make on an endpoint with `in_flight` of tokentap's.
pub(super) fn next_batch(meter: &EndpointMeter, in_flight: u64) -> f64 {
    meter.batch(in_flight) as f64 + 1.0
}

/// An endpoint's curve over its requests of the last [`FIT_WINDOW`], and its controller's
/// evidence: the `percentile` of the TPOT of those that finished since `since` and the mean
/// batch they ran in.
pub(super) fn evidence(
    meter: &EndpointMeter,
    now: Nanos,
    since: Nanos,
    percentile: f64,
) -> (Fit, Tick) {
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
    pub(super) fn rank(&self, h: &Headroom, x: f64) -> Option<Rank> {
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
    pub(super) fn at(&self, x: f64) -> f64 {
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
