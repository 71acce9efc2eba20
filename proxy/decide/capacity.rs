//! Capacity: how many endpoints the current demand needs at the SLO, from the pool's own
//! live curve, whatever the engine.
//!
//! Demand is tokens per second asked for: what was delivered plus what the queue holds
//! back. A backlog shows in one of two ways. Clients that do not wait for each other (an
//! open loop, like real users) arrive faster than the pool finishes: the arrivals over the
//! window (admitted at once, queued or refused) × the mean output tokens of those that
//! finished run ahead of the delivered T/s, and they are the demand. Clients that wait for
//! their answer before they ask again (a closed loop) arrive only as fast as they are
//! served, and wait in a standing queue instead: then each of them asks as much as an
//! in-flight request gets, and the demand is the arrivals' × (mean in flight + queued) ÷
//! mean in flight. One endpoint delivers at most its SLO-bounded system T/s (the curve is
//! one endpoint's); with `headroom_pct` on top, the pool needs ⌈demand × (1 + headroom) ÷
//! that⌉. The bound is taken only where the curve shows it: a supported
//! point within the SLO with one above it that breaks it (`bracketed`), or running at 80%
//! of the TPOT SLO or with requests that broke it (`near_slo`). A curve that never came near
//! its SLO gives no figure and says why: what lies past the highest concurrency seen is not
//! extrapolated.
//!
//! The figure is held steady ([`Steady`]) so that an autoscaler can act on it: the need
//! sampled once a second, its median over the last [`STEADY_WINDOWS`] live windows (30 s
//! at the default `metrics.window_secs`: each sample is itself a window's figure), and a
//! held value that
//! moves up only when the median is past it by a margin and down only when one endpoint
//! fewer would still leave that margin spare. The margin is half the headroom (of the
//! endpoints it is taken on; [`MIN_MARGIN`] at least): a median that eats less than half
//! the headroom still leaves the pool within its SLO, and the need's own noise (arrivals
//! counted over a window: ±5% a second at 37 requests a second) stays inside it. A load
//! near a whole number of endpoints (3.97 one second, 4.3 the next) or a second's gap in
//! the window's figures moves it no more; a step in the load moves it within the median's
//! half-window plus the live window.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use serde::Serialize;

use crate::meter::{Nanos, SloBound};

/// How far back the held figure's median looks, in live windows.
pub const STEADY_WINDOWS: u64 = 3;
/// The need is sampled at most this often (however often `/stats` is asked).
const SAMPLE_EVERY: Nanos = 900_000_000;
/// The least margin, in endpoints, that moves the held figure: the median this far past
/// it raises it, one endpoint fewer leaving this much spare lowers it. With headroom, the
/// margin is half of it.
pub const MIN_MARGIN: f64 = 0.1;
/// Samples before the held figure keeps to its margins: until then (the first seconds,
/// when the window's figures are young) it follows the median, so a start that reads high
/// is not held.
const SETTLED: usize = 10;

/// What capacity is computed from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    /// The live window's system T/s (delivered).
    pub system_tps: Option<f64>,
    /// Generation requests that arrived over the window, per second, and the mean output
    /// tokens of those that finished there.
    pub arrivals_per_sec: Option<f64>,
    pub mean_output_tokens: Option<f64>,
    /// The window's mean of requests in flight, and those waiting for a slot now.
    pub concurrency: Option<f64>,
    pub queued: u64,
    /// Endpoints taking requests now.
    pub endpoints_now: u64,
}

/// The capacity's part of `/stats`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CapacityStats {
    /// Tokens per second asked for: `arrivals_per_sec` × `mean_output_tokens`, scaled by
    /// a standing queue (`demand_from`).
    pub demand_tps: Option<f64>,
    /// `arrivals` (arriving faster than served, or no queue) or `standing_queue` (served
    /// as fast as they arrive, more waiting).
    pub demand_from: Option<&'static str>,
    pub arrivals_per_sec: Option<f64>,
    pub mean_output_tokens: Option<f64>,
    /// Tokens per second delivered (the window's system T/s), and requests waiting now.
    pub delivered_tps: Option<f64>,
    pub queued: u64,
    /// One endpoint's SLO-bounded system T/s, and the concurrency where the curve shows it.
    pub slo_bounded_tps_per_endpoint: Option<f64>,
    pub slo_bounded_concurrency: Option<u64>,
    pub endpoints_now: u64,
    /// Endpoints needed, held steady ([`Steady`]): what an autoscaler acts on.
    pub endpoints_needed: Option<u64>,
    /// The need this moment, unrounded and not held: demand × (1 + headroom) ÷ one
    /// endpoint's SLO-bounded T/s.
    pub need_now: Option<f64>,
    pub headroom_pct: f64,
    /// Where the bound comes from: `bracketed` or `near_slo`; `null` with `reason`.
    pub basis: Option<&'static str>,
    /// `enough` or `add N`; `null` with `reason`.
    pub advice: Option<String>,
    /// Why there is no figure.
    pub reason: Option<String>,
}

/// The pool's capacity for `demand` under its SLO's `bound` (`None`: no point within it),
/// `slo` saying whether there is an SLO at all.
pub fn capacity(
    demand: Demand,
    bound: Option<SloBound>,
    slo: bool,
    headroom_pct: f64,
) -> CapacityStats {
    let delivered = demand.system_tps;
    let arriving = match (demand.arrivals_per_sec, demand.mean_output_tokens) {
        (Some(a), Some(tokens)) => Some(a * tokens),
        (Some(0.0), None) => Some(0.0),
        _ => None,
    };
    let (demand_tps, demand_from) = match (arriving, delivered, demand.concurrency) {
        (Some(a), Some(d), _) if a > 1.05 * d => (Some(a), Some("arrivals")),
        (Some(a), _, Some(c)) if c > 0.0 && demand.queued > 0 => (
            Some(a * (c + demand.queued as f64) / c),
            Some("standing_queue"),
        ),
        (Some(a), ..) => (Some(a), Some("arrivals")),
        (None, ..) => (None, None),
    };
    let (basis, reason) = match bound {
        _ if !slo => (
            None,
            Some("no [upstream.slo]: capacity is counted at an SLO".into()),
        ),
        None => (
            None,
            Some("no supported curve point meets the SLO yet".to_owned()),
        ),
        Some(b) if b.bracketed => (Some("bracketed"), None),
        Some(b) if b.near => (Some("near_slo"), None),
        Some(b) => (
            None,
            Some(format!(
                "the curve has not come near the SLO: up to {} in flight per endpoint it holds \
                 with room to spare, and what lies beyond is not extrapolated",
                b.highest_supported
            )),
        ),
    };
    let per_endpoint = bound.filter(|_| basis.is_some()).map(|b| b.system_tps);
    let need_now = demand_tps
        .zip(per_endpoint)
        .filter(|&(_, per)| per > 0.0)
        .map(|(d, per)| d * (1.0 + headroom_pct / 100.0) / per);
    let needed = need_now.map(whole);
    let advice = needed.map(|n| advice(n, demand.endpoints_now));
    let reason = reason.or_else(|| {
        (basis.is_some() && demand_tps.is_none())
            .then(|| "no request finished in the window yet: its mean output is unknown".to_owned())
    });
    CapacityStats {
        demand_tps,
        demand_from,
        arrivals_per_sec: demand.arrivals_per_sec,
        mean_output_tokens: demand.mean_output_tokens,
        delivered_tps: delivered,
        queued: demand.queued,
        slo_bounded_tps_per_endpoint: per_endpoint,
        slo_bounded_concurrency: bound.filter(|_| basis.is_some()).map(|b| b.concurrency),
        endpoints_now: demand.endpoints_now,
        endpoints_needed: needed,
        need_now: need_now.map(|n| (n * 100.0).round() / 100.0),
        headroom_pct,
        basis,
        advice,
        reason,
    }
}

/// Whole endpoints for a need (at least one).
fn whole(need: f64) -> u64 {
    (need - 1e-9).ceil().max(1.0) as u64
}

/// `enough` or `add N`, for `needed` against `now`.
fn advice(needed: u64, now: u64) -> String {
    if needed <= now {
        "enough".to_owned()
    } else {
        format!("add {}", needed - now)
    }
}

/// The endpoints needed as an autoscaler may act on them (see the module's head): one per
/// upstream, kept across reloads.
#[derive(Debug, Default)]
pub struct Steady(Mutex<SteadyState>);

#[derive(Debug, Default)]
struct SteadyState {
    /// (when, need) sampled, oldest first.
    samples: VecDeque<(Nanos, f64)>,
    held: Option<u64>,
}

impl Steady {
    /// `c` at `now` with its `endpoints_needed` and `advice` held steady, the median taken
    /// over the last `over` (see [`STEADY_WINDOWS`]).
    pub fn hold(&self, now: Nanos, mut c: CapacityStats, over: Nanos) -> CapacityStats {
        let mut st = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let due = (st.samples.back()).is_none_or(|&(at, _)| now.saturating_sub(at) >= SAMPLE_EVERY);
        if let Some(need) = c.need_now.filter(|_| due) {
            st.samples.push_back((now, need));
        }
        while (st.samples.front()).is_some_and(|&(at, _)| now.saturating_sub(at) > over) {
            st.samples.pop_front();
        }
        let mut needs: Vec<f64> = st.samples.iter().map(|&(_, n)| n).collect();
        needs.sort_by(f64::total_cmp);
        // The upper median: one of the needs seen, never a mean of two.
        let median = needs.get(needs.len() / 2).copied();
        let settled = st.samples.len() >= SETTLED;
        // Half the headroom of `n` endpoints, in endpoints.
        let margin = |n: u64| (n as f64 * c.headroom_pct / 200.0).max(MIN_MARGIN);
        st.held = median.map(|m| match st.held {
            // Kept while the median is not past it and one fewer would not leave room.
            Some(n)
                if settled && m <= n as f64 + margin(n) && m > (n - 1) as f64 - margin(n - 1) =>
            {
                n
            }
            _ => whole(m),
        });
        c.endpoints_needed = st.held;
        c.advice = st.held.map(|n| advice(n, c.endpoints_now));
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The median's span at the default window (10 s).
    const OVER: Nanos = 30_000_000_000;

    fn bound(system_tps: f64, bracketed: bool, near: bool) -> SloBound {
        SloBound {
            concurrency: 8,
            system_tps,
            tpot_ms: Some(28.0),
            bracketed,
            near,
            highest_supported: 16,
        }
    }

    #[test]
    fn three_x_of_demand_on_x_per_endpoint_needs_four_with_headroom() {
        // Two endpoints capped at their SLO-bounded 400 T/s each deliver 800 T/s; requests
        // of 100 tokens arrive at 12 a second: demand 1200 T/s, the queue growing.
        let d = Demand {
            system_tps: Some(800.0),
            arrivals_per_sec: Some(12.0),
            mean_output_tokens: Some(100.0),
            concurrency: Some(8.0),
            queued: 8,
            endpoints_now: 2,
        };
        let c = capacity(d, Some(bound(400.0, true, true)), true, 20.0);
        assert_eq!(c.demand_tps, Some(1200.0));
        assert_eq!(c.demand_from, Some("arrivals"));
        assert_eq!(c.endpoints_needed, Some(4));
        assert_eq!(c.advice.as_deref(), Some("add 2"));
        assert_eq!(c.basis, Some("bracketed"));
        // Four endpoints later the queue is gone and the demand served.
        let after = Demand {
            system_tps: Some(1200.0),
            queued: 0,
            endpoints_now: 4,
            ..d
        };
        let c = capacity(after, Some(bound(400.0, true, true)), true, 20.0);
        assert_eq!(
            (c.endpoints_needed, c.advice.as_deref()),
            (Some(4), Some("enough"))
        );
    }

    #[test]
    fn clients_that_wait_their_turn_show_in_a_standing_queue() {
        // 24 closed-loop clients on one endpoint capped at 8: served as fast as they
        // arrive (400 T/s), 16 waiting. Each asks what an in-flight request gets.
        let d = Demand {
            system_tps: Some(400.0),
            arrivals_per_sec: Some(4.0),
            mean_output_tokens: Some(100.0),
            concurrency: Some(8.0),
            queued: 16,
            endpoints_now: 1,
        };
        let c = capacity(d, Some(bound(400.0, true, true)), true, 0.0);
        assert_eq!(c.demand_tps, Some(1200.0));
        assert_eq!(c.demand_from, Some("standing_queue"));
        assert_eq!(
            (c.endpoints_needed, c.advice.as_deref()),
            (Some(3), Some("add 2"))
        );
    }

    #[test]
    fn no_figure_without_a_point_near_the_slo() {
        let d = Demand {
            system_tps: Some(100.0),
            arrivals_per_sec: Some(1.0),
            mean_output_tokens: Some(100.0),
            concurrency: Some(2.0),
            queued: 0,
            endpoints_now: 1,
        };
        let far = capacity(d, Some(bound(400.0, false, false)), true, 20.0);
        assert_eq!((far.endpoints_needed, far.basis), (None, None));
        assert!(far
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("16 in flight")));
        let none = capacity(d, None, true, 20.0);
        assert!(none.reason.is_some() && none.endpoints_needed.is_none());
        let no_slo = capacity(d, Some(bound(400.0, true, true)), false, 20.0);
        assert!(no_slo
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("[upstream.slo]")));
        let near = capacity(d, Some(bound(400.0, false, true)), true, 0.0);
        assert_eq!(
            (near.endpoints_needed, near.basis),
            (Some(1), Some("near_slo"))
        );
    }

    fn stats(need: Option<f64>) -> CapacityStats {
        with_headroom(need, 0.0)
    }

    fn with_headroom(need: Option<f64>, headroom_pct: f64) -> CapacityStats {
        let d = Demand {
            system_tps: Some(100.0),
            arrivals_per_sec: Some(1.0),
            mean_output_tokens: Some(100.0),
            concurrency: Some(2.0),
            queued: 0,
            endpoints_now: 3,
        };
        CapacityStats {
            need_now: need,
            ..capacity(d, Some(bound(400.0, true, true)), true, headroom_pct)
        }
    }

    #[test]
    fn the_held_figure_moves_past_half_the_headroom() {
        const SEC: Nanos = 1_000_000_000;
        let steady = Steady::default();
        let mut at = 0;
        let mut hold = |need: f64, secs: u64| {
            let mut held = Vec::new();
            for _ in 0..secs {
                at += SEC;
                held.push(
                    steady
                        .hold(at, with_headroom(Some(need), 20.0), OVER)
                        .endpoints_needed,
                );
            }
            held
        };
        // Settled on 4 (a need of 3.8), 20% headroom: 4 moves up past 4.4 only.
        assert_eq!(hold(3.8, 12).last(), Some(&Some(4)));
        let wander: Vec<_> = [4.3, 4.05, 4.35, 3.92, 4.4]
            .iter()
            .flat_map(|&n| hold(n, 20))
            .collect();
        assert!(wander.iter().all(|&n| n == Some(4)), "{wander:?}");
        assert_eq!(hold(4.5, 20).last(), Some(&Some(5)));
        // Down from 5 only when 4 leave 0.4 spare: 3.7 holds 5, 3.55 lowers it.
        let hovering = hold(3.7, 40);
        assert!(hovering.iter().all(|&n| n == Some(5)), "{hovering:?}");
        assert_eq!(hold(3.55, 20).last(), Some(&Some(4)));
    }

    #[test]
    fn the_held_figure_is_steady_under_a_steady_load_and_follows_a_step() {
        const SEC: Nanos = 1_000_000_000;
        let steady = Steady::default();
        // A load near four endpoints: 3.97 one second, 4.1 the next, a gap, a second that
        // read 1.6 (the window between two figures).
        let noisy = [3.97, 4.1, 4.05, 1.6, 4.08, 3.99];
        let held: Vec<Option<u64>> = (0..60u64)
            .map(|i| {
                let need = (i % 7 != 6).then(|| noisy[(i % 7) as usize % noisy.len()]);
                steady.hold(i * SEC, stats(need), OVER).endpoints_needed
            })
            .collect();
        // Each second alone reads 4, 5 or 2; held: one value once settled.
        assert!(held[12..].iter().all(|&n| n == held[12]), "{held:?}");
        assert!(matches!(held[12], Some(4 | 5)), "{held:?}");
        // The load doubles: the held figure follows within the median's half-window.
        let moved = (60..120u64)
            .find(|&i| {
                steady
                    .hold(i * SEC, stats(Some(8.3)), OVER)
                    .endpoints_needed
                    == Some(9)
            })
            .expect("it moves");
        assert!(moved - 60 <= OVER / SEC / 2 + 1, "{moved}");
        let c = steady.hold(121 * SEC, stats(Some(8.3)), OVER);
        assert_eq!(c.advice.as_deref(), Some("add 6"));
        // And back down when one fewer is clearly enough: 8.3 → 7.8 holds 9 → 8.
        let down = (122..200u64)
            .find(|&i| {
                steady
                    .hold(i * SEC, stats(Some(7.8)), OVER)
                    .endpoints_needed
                    == Some(8)
            })
            .expect("it comes down");
        assert!(down - 122 <= OVER / SEC / 2 + 1, "{down}");
        // Asked many times a second, it samples once a second.
        let many = Steady::default();
        for i in 0..100u64 {
            many.hold(
                i * SEC / 100,
                stats(Some(if i < 95 { 2.0 } else { 6.0 })),
                OVER,
            );
        }
        assert_eq!(many.hold(SEC, stats(None), OVER).endpoints_needed, Some(2));
    }
}
