//! The adaptive SLO controller: moves an upstream's concurrency limit so that the chosen
//! percentile of TPOT stays under the SLO while system T/s is as high as it can be.
//!
//! Why this design. On a batching backend TPOT rises with the batch, nearly linearly over
//! the range that matters (the reference curve, `sim::Curve::reference`), so the limit that meets the SLO is where the line
//! TPOT ≈ a + b·c crosses it. Each tick (1 s) the controller gets the percentile of the
//! per-token gaps of every in-flight stream over that tick and the tick's time-weighted
//! concurrency; it fits the line over recent ticks and aims at the concurrency where TPOT
//! meets 95% of the SLO. Around the model it keeps three guards that make it safe when the
//! model is poor (no spread in concurrency yet, or the backend just changed):
//!
//! - **raise** only while the measured percentile is comfortably below the SLO (< 93%) and
//!   the limit actually binds (requests queued, or concurrency near the limit); by at most
//!   25% per tick, by at least 1, and not past the model's target;
//! - **hold** inside the dead band between 93% and 100% of the SLO, so a converged limit
//!   does not oscillate;
//! - **cut** when the SLO is missed: to the model's target if it is lower, else by 15%,
//!   never by more than half; then wait until the in-flight count has come down to the new
//!   limit before judging again, since a cut only stops new admissions and the next tick
//!   still shows the old batch (the same evidence must not cut twice).
//!
//! Envoy's gradient controller and Netflix's Gradient2 track latency against a measured
//! minimum; here the target is an absolute SLO on a known-monotone curve, so a fitted line
//! with AIMD-style guards converges faster and settles without the probing oscillation of a
//! pure AIMD.

use std::collections::VecDeque;

/// An SLO to hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    pub tpot_ms: f64,
    /// Which percentile of per-token gaps must stay under `tpot_ms` (1–99.9).
    pub percentile: f64,
    pub min_concurrency: u64,
    pub max_concurrency: u64,
}

/// What the controller sees each tick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tick {
    /// The SLO percentile of per-token gaps over the tick, ms; `None` without traffic.
    pub tpot_ms: Option<f64>,
    /// Time-weighted mean of requests in flight over the tick.
    pub concurrency: f64,
    /// Requests in flight now.
    pub in_flight: u64,
    /// Requests queued or were refused because of the limit during the tick.
    pub queued: bool,
}

const HISTORY: usize = 20;
const TARGET: f64 = 0.95;
const RAISE_BELOW: f64 = 0.93;
const MAX_RAISE: f64 = 0.25;
const CUT: f64 = 0.85;

pub struct Controller {
    slo: Slo,
    limit: u64,
    /// (concurrency, TPOT percentile) of recent ticks.
    history: VecDeque<(f64, f64)>,
    /// After a cut: no judging until in-flight has come down to this.
    drain_to: Option<u64>,
}

impl Controller {
    /// Starts at `min_concurrency` (at least 4: a cold start at 1 is needlessly slow).
    pub fn new(slo: Slo) -> Controller {
        Controller {
            limit: slo.min_concurrency.max(4).min(slo.max_concurrency),
            slo,
            history: VecDeque::with_capacity(HISTORY),
            drain_to: None,
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Holds `slo` from now on, from the current limit (within the new bounds). The history
    /// was judged against the old SLO and is dropped.
    pub fn retune(&mut self, slo: Slo) {
        if slo == self.slo {
            return;
        }
        self.limit = self.limit.clamp(slo.min_concurrency, slo.max_concurrency);
        self.slo = slo;
        self.history.clear();
        self.drain_to = None;
    }

    /// Another replica leads the fleet's controller: the limit is its, within this SLO's
    /// bounds. Its history is not this one's, so nothing is kept to judge by: should this
    /// replica lead next, it starts from the fleet's limit with a fresh fit.
    pub fn follow(&mut self, limit: u64) {
        self.limit = limit.clamp(self.slo.min_concurrency.max(1), self.slo.max_concurrency);
        self.history.clear();
        self.drain_to = None;
    }

    /// The concurrency at which the fitted line meets 95% of the SLO, if the recent ticks
    /// spread wide enough to fit one with a rising slope.
    pub fn target(&self) -> Option<f64> {
        let n = self.history.len() as f64;
        if n < 3.0 {
            return None;
        }
        let (lo, hi) = self
            .history
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &(c, _)| {
                (lo.min(c), hi.max(c))
            });
        if hi - lo < 2.0 {
            return None;
        }
        let mc = self.history.iter().map(|p| p.0).sum::<f64>() / n;
        let mp = self.history.iter().map(|p| p.1).sum::<f64>() / n;
        let sxy: f64 = self.history.iter().map(|&(c, p)| (c - mc) * (p - mp)).sum();
        let sxx: f64 = self.history.iter().map(|&(c, _)| (c - mc) * (c - mc)).sum();
        let b = sxy / sxx;
        if b.is_nan() || b <= 1e-9 {
            return None;
        }
        let a = mp - b * mc;
        Some((TARGET * self.slo.tpot_ms - a) / b)
    }

    /// One tick: returns the new limit.
    pub fn update(&mut self, t: Tick) -> u64 {
        let Some(p) = t.tpot_ms.filter(|p| p.is_finite()) else {
            return self.limit;
        };
        if let Some(to) = self.drain_to {
            if t.in_flight > to {
                return self.limit;
            }
            // This tick still mixed the old batch in: judge from the next one.
            self.drain_to = None;
            return self.limit;
        }
        if t.concurrency >= 1.0 {
            if self.history.len() == HISTORY {
                self.history.pop_front();
            }
            self.history.push_back((t.concurrency, p));
        }
        let slo = self.slo.tpot_ms;
        let limit = self.limit as f64;
        let new = if p > slo {
            let floor = (limit * 0.5).max(1.0);
            let proposal = self.target().filter(|&c| c < limit).unwrap_or(limit * CUT);
            let new = (proposal.floor().max(floor) as u64).min(self.limit.saturating_sub(1).max(1));
            self.drain_to = Some(new);
            new
        } else if p < RAISE_BELOW * slo && (t.queued || t.concurrency >= 0.9 * limit) {
            let cap = (limit * MAX_RAISE).max(1.0);
            let want = self.target().map_or(cap, |c| c - limit);
            self.limit + want.clamp(1.0, cap).floor() as u64
        } else {
            self.limit
        };
        self.limit = new.clamp(self.slo.min_concurrency.max(1), self.slo.max_concurrency);
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::Curve;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    const SLO: Slo = Slo {
        tpot_ms: 30.0,
        percentile: 90.0,
        min_concurrency: 1,
        max_concurrency: 512,
    };

    /// A discrete model of 128 closed-loop clients on a batching backend: the batch is the
    /// limit (every slot refilled at once), p90 of per-token gaps is the curve at that batch
    /// with 1% noise, and after a cut the batch drains in one tick.
    struct Model {
        curve: Curve,
        clients: u64,
        rng: StdRng,
        in_flight: u64,
    }

    impl Model {
        fn tick(&mut self, limit: u64) -> Tick {
            let c = limit.min(self.clients);
            // In-flight falls to the new limit as requests finish (one tick).
            let mean = (self.in_flight + c) as f64 / 2.0;
            self.in_flight = c;
            let noise = 1.0 + self.rng.gen_range(-0.01..0.01);
            Tick {
                tpot_ms: Some(self.curve.tpot_ms(mean) * noise),
                concurrency: mean,
                in_flight: c,
                queued: self.clients > limit,
            }
        }
    }

    fn run(ctl: &mut Controller, m: &mut Model, ticks: usize) -> Vec<u64> {
        (0..ticks)
            .map(|_| {
                let t = m.tick(ctl.limit());
                ctl.update(t)
            })
            .collect()
    }

    fn cv(v: &[u64]) -> f64 {
        let n = v.len() as f64;
        let mean = v.iter().sum::<u64>() as f64 / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        var.sqrt() / mean
    }

    fn model(seed: u64) -> Model {
        Model {
            curve: Curve::reference(),
            clients: 128,
            rng: StdRng::seed_from_u64(seed),
            in_flight: 0,
        }
    }

    #[test]
    fn converges_to_the_crossing_and_stays() {
        for seed in 0..10 {
            let mut ctl = Controller::new(SLO);
            let mut m = model(seed);
            let limits = run(&mut ctl, &mut m, 120);
            // The reference curve meets 30 ms at ~90 in flight.
            let settled = limits
                .iter()
                .position(|&l| (72..=96).contains(&l))
                .expect("reaches the band");
            assert!(settled < 60, "seed {seed}: {limits:?}");
            assert!(
                limits[60..].iter().all(|l| (72..=96).contains(l)),
                "seed {seed}: {limits:?}"
            );
            assert!(
                limits[60..]
                    .iter()
                    .all(|&l| Curve::reference().tpot_ms(l as f64) <= 30.0),
                "{limits:?}"
            );
            assert!(cv(&limits[90..]) < 0.10, "seed {seed}: {limits:?}");
        }
    }

    #[test]
    fn re_converges_after_the_backend_slows_down() {
        for (factor, band) in [(1.5, 1..=2u64), (1.2, 40..=53)] {
            let mut ctl = Controller::new(SLO);
            let mut m = model(7);
            run(&mut ctl, &mut m, 120);
            m.curve = Curve::reference().scaled(factor);
            let limits = run(&mut ctl, &mut m, 120);
            let settled = limits
                .iter()
                .position(|l| band.contains(l))
                .expect("reaches the new band");
            assert!(settled < 60, "×{factor}: {limits:?}");
            assert!(
                limits[60..].iter().all(|l| band.contains(l)),
                "×{factor}: {limits:?}"
            );
            assert!(
                limits[60..]
                    .iter()
                    .all(|&l| m.curve.tpot_ms(l as f64) <= 30.0 * 1.001),
                "×{factor}: {limits:?}"
            );
        }
    }

    #[test]
    fn a_cut_waits_for_the_batch_to_drain() {
        let mut ctl = Controller::new(SLO);
        ctl.limit = 100;
        let miss = Tick {
            tpot_ms: Some(40.0),
            concurrency: 100.0,
            in_flight: 100,
            queued: true,
        };
        let after = ctl.update(miss);
        assert!(after < 100);
        assert_eq!(ctl.update(miss), after, "same evidence, no second cut");
        let drained = Tick {
            in_flight: after,
            concurrency: after as f64,
            ..miss
        };
        assert_eq!(
            ctl.update(drained),
            after,
            "the first drained tick still mixes the old batch"
        );
        assert!(
            ctl.update(drained) < after,
            "fresh evidence of a miss cuts again"
        );
    }

    #[test]
    fn no_traffic_no_change_and_bounds_hold() {
        let slo = Slo {
            min_concurrency: 8,
            max_concurrency: 20,
            ..SLO
        };
        let mut ctl = Controller::new(slo);
        assert_eq!(ctl.limit(), 8);
        let idle = Tick {
            tpot_ms: None,
            concurrency: 0.0,
            in_flight: 0,
            queued: false,
        };
        assert_eq!(ctl.update(idle), 8);
        let fast = Tick {
            tpot_ms: Some(10.0),
            concurrency: 8.0,
            in_flight: 8,
            queued: true,
        };
        for _ in 0..50 {
            ctl.update(Tick {
                concurrency: ctl.limit() as f64,
                in_flight: ctl.limit(),
                ..fast
            });
        }
        assert_eq!(ctl.limit(), 20);
        let not_binding = Tick {
            tpot_ms: Some(10.0),
            concurrency: 3.0,
            in_flight: 3,
            queued: false,
        };
        assert_eq!(
            ctl.update(not_binding),
            20,
            "never raised while the limit does not bind"
        );
    }
}
