//! The figures the admin API reports (docs/admin-api.md): a snapshot of one upstream's windows.
//! Figures without data are `None` (JSON `null`), never 0 and never NaN.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use serde::Serialize;

/// p50/p90/p99 of a set of samples, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Percentiles {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
}

// === impl Percentiles ===

impl Percentiles {
    /// Nearest-rank percentiles of `samples`, which are reordered (not sorted).
    ///
    /// Each rank is selected rather than the whole slice sorted: the window can hold
    /// hundreds of thousands of short requests, and the dashboard's sampler reads them every
    /// second. p50 is selected first; p90 and then p99 lie in the part after it, half the
    /// samples and then a tenth (1.6 passes over them in all, against 2.9 from p99 down).
    ///
    /// Samples are durations, none below zero. Without a sign bit, `f64::total_cmp`'s order
    /// is the order of the bits as integers, which are compared so (one instruction, where
    /// `total_cmp` turns each side first): the same ranks for a third of the instructions.
    /// A set with a negative or `-0.0` is compared by `total_cmp` itself.
    pub fn of(samples: &mut [f64]) -> Percentiles {
        if samples.iter().all(|v| v.is_sign_positive()) {
            Self::select(samples, |a, b| a.to_bits().cmp(&b.to_bits()))
        } else {
            Self::select(samples, f64::total_cmp)
        }
    }

    fn select(samples: &mut [f64], order: impl Fn(&f64, &f64) -> Ordering + Copy) -> Percentiles {
        let n = samples.len();
        if n == 0 {
            return Percentiles::default();
        }
        let mut found = [None; 3];
        // Each selection leaves every larger sample after the selected one, so the next,
        // higher rank is found in that suffix alone.
        let mut start = 0;
        for (slot, p) in [(0, 50.0), (1, 90.0), (2, 99.0)] {
            let k = rank(n, p) - 1;
            let (_, v, _) = samples[start..].select_nth_unstable_by(k - start, order);
            found[slot] = Some(*v);
            start = k;
        }
        let [p50, p90, p99] = found;
        Percentiles { p50, p90, p99 }
    }
}

/// The 1-based nearest rank of percentile `p` among `len` > 0 samples.
fn rank(len: usize, p: f64) -> usize {
    (((p / 100.0) * len as f64).ceil() as usize).clamp(1, len)
}

/// The distribution of tokens per token-bearing fragment.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct TokensPerEvent {
    pub mean: Option<f64>,
    pub p50: Option<u64>,
    pub p90: Option<u64>,
    pub max: Option<u64>,
}

impl TokensPerEvent {
    pub fn of(h: &hdrhistogram::Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        TokensPerEvent {
            mean: Some(h.mean()),
            p50: Some(h.value_at_quantile(0.5)),
            p90: Some(h.value_at_quantile(0.9)),
            max: Some(h.max()),
        }
    }
}

/// One point of the concurrency→TPOT curve: the tokens that arrived while the upstream had
/// between `concurrency / 2 + 1` and `concurrency` requests in flight, over the last
/// `metrics.curve_window_secs`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CurvePoint {
    pub concurrency: u64,
    pub tpot_ms_p50: Option<f64>,
    pub tpot_ms_p90: Option<f64>,
    pub single_stream_tps: Option<f64>,
    pub system_tps: Option<f64>,
    /// The time-weighted mean concurrency while in this bucket.
    pub mean_concurrency: Option<f64>,
    /// Per-token gaps measured in this bucket.
    pub samples: u64,
    /// Too little support to be a point (under 2 s in the bucket or 50 gaps): shown here,
    /// left out of `/metrics`, not to be read as the backend's figure.
    pub sparse: bool,
    /// Requests judged against `[upstream.slo]` that ran at this concurrency (the mean
    /// batch their tokens arrived at), and the share of them that were good, percent.
    pub slo_requests: u64,
    pub slo_attainment_pct: Option<f64>,
}

/// What the meter knows of one upstream: its part of `/stats`, which the admin API combines
/// with the limiter's and the routes'.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MeterStats {
    pub name: String,
    pub in_flight: u64,
    pub requests_total: u64,
    pub errors_total: u64,
    /// Output tokens of finished requests (exact counts where the stream gave one).
    pub output_tokens_total: u64,
    /// Prompt tokens of the requests whose stream reported them.
    pub input_tokens_total: u64,
    /// Of those, the tokens the backend said it read from its prefix cache.
    pub cached_input_tokens_total: u64,
    /// Cached prompt tokens over the prompt tokens of the requests that finished in the
    /// window saying how many were cached, percent; `null` when none said (a backend that
    /// does not report it: no figure is guessed).
    pub cache_hit_rate_pct: Option<f64>,
    /// Whether every completed generation was counted exactly; `null` before the first.
    pub counts_exact: Option<bool>,
    /// Output tokens that rest on the one-per-event estimate (no exact count arrived).
    pub estimated_output_tokens_total: u64,
    /// Their share of `output_tokens_total`, percent.
    pub estimated_tokens_share_pct: Option<f64>,
    /// For requests whose exact count arrived after estimates: Σ estimate / Σ exact (how far
    /// one token per event is from the truth on this upstream).
    pub estimate_to_exact_ratio: Option<f64>,
    /// How many tokens each token-bearing fragment carried, since start (> 1 with
    /// speculative decoding, stream intervals or coalesced writes).
    pub tokens_per_event: TokensPerEvent,
    pub requests_by_status: BTreeMap<&'static str, u64>,
    pub unparsed_events_total: u64,
    pub system_tps: Option<f64>,
    pub single_stream_tps: Option<f64>,
    pub concurrency: Option<f64>,
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub itl_ms: Percentiles,
    /// End-to-end latency of requests that finished in the window (non-streaming included).
    pub e2e_ms: Percentiles,
    /// Generation requests that asked for a slot over the window (admitted, queued or
    /// refused), per second.
    pub arrivals_per_sec: Option<f64>,
    /// Output tokens per generation request that finished in the window.
    pub mean_output_tokens: Option<f64>,
    pub curve: Vec<CurvePoint>,
    /// Requests that met every `[upstream.slo]` over the window; `null` without one.
    pub goodput: Option<Goodput>,
    /// Finished requests since start by verdict: `good`, the first SLO broken (`ttft`,
    /// `tpot`, `e2e`) or `error` (all 0 without an SLO).
    #[serde(skip)]
    pub slo_requests_total: Vec<(&'static str, u64)>,
}

/// Goodput over the live window: the requests that met every latency SLO set.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Goodput {
    pub requests_per_sec: Option<f64>,
    /// Output tokens of the good requests, per second.
    pub output_tokens_per_sec: Option<f64>,
    /// Good requests among those judged, percent; `null` before the first.
    pub attainment_pct: Option<f64>,
    /// Requests judged in the window (finished generations, errors included), and the good.
    pub requests: u64,
    pub good_requests: u64,
    /// Requests in the window whose clients left before they broke any SLO: not judged.
    pub cancelled: u64,
    /// The judged requests that were not good, by the first SLO each broke (or an error).
    pub broken: Broken,
}

/// Requests that were not good, by the first SLO each broke, or by an error.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Broken {
    pub ttft: u64,
    pub tpot: u64,
    pub e2e: u64,
    pub error: u64,
}

impl From<[u64; 4]> for Broken {
    /// By verdict, in [`Verdict::ALL`](super::Verdict::ALL)'s order without `Good`.
    fn from([ttft, tpot, e2e, error]: [u64; 4]) -> Broken {
        Broken {
            ttft,
            tpot,
            e2e,
            error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nearest-rank percentile `p` of sorted samples: the definition `of` selects.
    fn nearest_rank(sorted: &[f64], p: f64) -> Option<f64> {
        if sorted.is_empty() {
            return None;
        }
        Some(sorted[rank(sorted.len(), p) - 1])
    }

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&mut v);
        assert_eq!((p.p50, p.p90, p.p99), (Some(50.0), Some(90.0), Some(99.0)));
        assert_eq!(Percentiles::of(&mut []), Percentiles::default());
        assert_eq!(nearest_rank(&[7.0], 99.0), Some(7.0));
    }

    #[test]
    fn selected_percentiles_are_the_sorted_ones() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(18);
        for n in (1..=40).chain([99, 100, 101, 1_000, 4_321]) {
            // Few distinct values, so that ties sit across the selected ranks.
            let v: Vec<f64> = (0..n).map(|_| f64::from(rng.gen_range(0..12u8))).collect();
            let mut sorted = v.clone();
            sorted.sort_unstable_by(f64::total_cmp);
            let want = [50.0, 90.0, 99.0].map(|p| nearest_rank(&sorted, p));
            let got = Percentiles::of(&mut v.clone());
            assert_eq!([got.p50, got.p90, got.p99], want, "{n} samples");
        }
    }

    /// The integer order of the bits (no sign) and `total_cmp` (any sign) select the same
    /// samples, bit for bit, with zeros of both signs, infinities and NaNs among them.
    #[test]
    fn either_order_selects_the_sorted_ones() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(48);
        let odd = [
            0.0,
            -0.0,
            f64::INFINITY,
            f64::NAN,
            -f64::NAN,
            -3.5,
            f64::MIN_POSITIVE,
        ];
        for signed in [false, true] {
            for n in [1, 2, 3, 17, 100, 1_001, 20_000] {
                let v: Vec<f64> = (0..n)
                    .map(|_| match rng.gen_range(0..10u8) {
                        0 => odd[rng.gen_range(0..odd.len())],
                        _ => f64::from(rng.gen_range(0..50u16)) / 8.0,
                    })
                    .map(|x: f64| if signed { x } else { x.abs() })
                    .collect();
                let mut sorted = v.clone();
                sorted.sort_unstable_by(f64::total_cmp);
                let want = [50.0, 90.0, 99.0].map(|p| nearest_rank(&sorted, p).map(f64::to_bits));
                let got = Percentiles::of(&mut v.clone());
                let got = [got.p50, got.p90, got.p99].map(|g| g.map(f64::to_bits));
                assert_eq!(got, want, "{n} samples, signed {signed}");
            }
        }
    }
}
